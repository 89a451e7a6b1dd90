"""Every served family through `tandem local --model DIR`, as a user runs it: greedy tokens over
gRPC equal transformers' `generate` for a long prompt (prefilled by the prefill pod, its KV pulled
by the decode pod) and a short one (prefilled by the decode pod itself, the code the colocated
path runs), on the disaggregated path for every family and on the colocated path (`--colocated`)
for three that cover what the families change (windows with a RoPE per layer type and Gemma's
norms; experts; sinks, YaRN and biased experts), so the suite stays within its time.

Each checkpoint is written here by transformers' own class (tests/families.py: random weights,
windows of 8 positions, shorter than the prompts plus output). One cluster per family and path.
"""
from __future__ import annotations

import grpc
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tandem_proto import generate_pb2, generate_pb2_grpc
from tests.e2e.conftest import start_local, stop_local
from tests.families import FAMILIES, build_family, hf_greedy

pytestmark = pytest.mark.e2e
NEW = 12
LONG = [3 + (i * 37) % 250 for i in range(40)]  # > direct_prefill_max_tokens: through the prefill pod
SHORT = [7, 70, 170, 17]  # straight to the decode pod




def served(cluster, ids) -> list[int]:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
        req = generate_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=NEW, ignore_eos=True,
                                           sampling=generate_pb2.SamplingParameters(temperature=0))
        return [r.token_id for r in generate_pb2_grpc.TandemStub(ch).Generate(req, timeout=120)]


CASES = [(f, "disaggregated") for f in FAMILIES] + [(f, "colocated") for f in ("gemma3", "qwen3_moe", "gpt_oss")]


@pytest.mark.parametrize("family,path", CASES)
def test_family_serves_transformers_tokens(family, path, tmp_path):
    model = build_family(family, tmp_path / family, seed=5)
    extra = ["--colocated"] if path == "colocated" else []
    cluster = start_local(str(tmp_path / family), slots=2, max_len=128, extra=extra)
    try:
        for ids in (LONG, SHORT):
            assert served(cluster, ids) == hf_greedy(model, ids, NEW), f"{family} {path}: prompt of {len(ids)} tokens"
    finally:
        stop_local(cluster.proc)
