"""Families on several chips: tensor parallelism at 1, 2 and 4 simulated CPU devices, and for the
mixtures of experts expert parallelism (whole experts per chip) at 2 and 4 — greedy tokens equal
to transformers' in every layout, and at tp 4 by speculative verify calls too (one row's proposals
kept, the other's rejected). Every family at tp 2 and 4 through both of a decode pod's ways in: a
prompt prefilled whole and inserted (a pulled KV, the disaggregated path) and a prompt seated in a
row and prefilled in chunks by the ragged call beside the first row's steps (a colocated pod's
chunked prefill), both rows' tokens against transformers'.

The checkpoints are written here by transformers' classes (tests/families.py); XLA_FLAGS must be
set before JAX starts, so the engines run in a child process (this file as a script, with four
host CPU devices) that prints one JSON line of tokens and shard shapes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.families import FAMILIES, build_family, hf_greedy
from tests.ragged_rows import beside

# make test-unit leaves it out (make test runs it): a child process with 4 host devices compiles every
# family at tp 1, 2 and 4. With an empty compile cache (CI, a new machine) that child took more
# than the suite's 300 s here (2026-12-07): the module's setup gets the child's own 900 s and a minute
pytestmark = [pytest.mark.slow, pytest.mark.timeout(960)]

ROOT = Path(__file__).resolve().parents[2]
FAMS = ("gemma3", "qwen3_moe", "gpt_oss")  # windows + q/k norms; experts; sinks, biased experts, YaRN
STEPS = 12
PROMPTS = {0: list(range(30, 43)), 1: list(range(100, 140))}  # both longer than the window (8)
# (tp 1: tests/unit/test_engine_families.py, every family against transformers in one process)
LAYOUTS = {"gemma3": [(2, False), (4, False)],
           "qwen3_moe": [(2, False), (4, False), (2, True), (4, True)],
           "gpt_oss": [(4, False), (2, True), (4, True)]}
CHUNK = 16  # the ragged call's chunk: prompt 1 (40 tokens) in 3 calls, each crossing the window (8)


def speculated(e, want: dict[int, list[int]]) -> dict[str, list[int]]:
    """Greedy tokens per row by speculative verify calls (tandem_engine/speculative.py): row 0
    proposes its true continuation (every token kept, several a call), row 1 noise (each rejected)."""
    from tandem_core.types import SamplingParams

    greedy = SamplingParams()
    state, out = e.init_state(), {}
    for slot, ids in PROMPTS.items():
        prefix = e.prefill(ids, greedy)
        state = e.insert(prefix, state, slot, greedy)
        out[slot] = [prefix.first_token]
    while min(len(o) for o in out.values()) < STEPS:
        props = {s: (want[s][len(o):len(o) + 3] if s == 0 else [1, 2, 3]) for s, o in out.items()}
        state, res = e.verify(state, props, 3, e.slots)
        for s in out:
            out[s] += res.tokens[s, :res.counts[s]].tolist()
    return {str(s): o[:STEPS] for s, o in out.items()}


def child(spec: dict) -> dict:
    import jax

    from tandem_core.types import SamplingParams
    from tandem_engine import load_engine

    greedy = SamplingParams()
    out: dict = {"devices": len(jax.devices())}
    for fam, path in spec.items():
        for tp, ep in LAYOUTS.get(fam, ()):
            e = load_engine(path, slots=2, max_len=64, prefill_buckets=(64,), tp=tp, expert_parallel=ep)
            state = e.init_state()
            toks = {}
            for slot, ids in PROMPTS.items():
                prefix = e.prefill(ids, greedy)
                state = e.insert(prefix, state, slot, greedy)
                toks[slot] = [prefix.first_token]
            for _ in range(STEPS - 1):
                state, t = e.generate(state)
                host = np.asarray(t)
                for slot in PROMPTS:
                    toks[slot].append(int(host[slot]))
            layers = e.params["layers"]
            experts = layers.get("we_gate")
            verified = None
            if tp == 4 and not ep:  # speculative verify calls at tp 4 (tp 1 and 2: test_engine_paged_sharded.py)
                for slot in PROMPTS:
                    state = e.free(state, slot)
                verified = speculated(e, toks)
            out[f"{fam}/tp{tp}/ep{int(ep)}"] = {
                "tokens": {str(s): v for s, v in toks.items()}, "spec": verified,
                "wq_shard": list(layers["wq"].addressable_shards[0].data.shape),
                "experts_shard": None if experts is None else list(experts.addressable_shards[0].data.shape),
            }
    for fam, path in spec.items():
        for tp in (2, 4):
            # blocks of 4: windowed layers beside global ones keep their blocks apart (paged.WindowGroup,
            # 12 a row: the window, a chunk, and what a kept tail needs behind), and row 1 decodes far
            # enough that its first windowed blocks go back
            e = load_engine(path, slots=2, max_len=64, prefill_buckets=(64,), tp=tp, prefix_chunk=CHUNK,
                            kv_block_size=4)
            # row 0 prefilled whole and inserted, row 1 by the ragged call beside it
            res = beside(e, (0, PROMPTS[0]), (1, PROMPTS[1]), STEPS - 1, 2)
            held = [] if e._window is None else [int(np.count_nonzero(r)) for r in e._window.table]
            out[f"{fam}/tp{tp}/both_paths"] = {**res, "window_span": e.window_span, "window_held": held,
                                               "positions": [int(p) for p in e._pos]}
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    models, spec = {}, {}
    for fam in FAMILIES:
        path = tmp_path_factory.mktemp(fam)
        models[fam] = build_family(fam, path, seed=21)
        spec[fam] = str(path)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return models, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fam", FAMS)
def test_tokens_equal_transformers_in_every_layout(run, fam):
    models, res = run
    assert res["devices"] == 4
    want = {str(s): hf_greedy(models[fam], ids, STEPS) for s, ids in PROMPTS.items()}
    for tp, ep in LAYOUTS[fam]:
        got = res[f"{fam}/tp{tp}/ep{int(ep)}"]["tokens"]
        assert got == want, f"{fam} tp={tp} expert_parallel={ep}"
    assert res[f"{fam}/tp4/ep0"]["spec"] == want, f"{fam} tp=4: speculative verify calls"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("fam", FAMILIES)
def test_every_family_through_both_paths_equals_transformers(run, fam, tp):
    """Row 0 prefilled whole and inserted, row 1 prefilled by the ragged call in chunks of CHUNK
    beside row 0's steps, at tp 2 and 4: each row's greedy tokens are transformers'."""
    models, res = run
    got = res[f"{fam}/tp{tp}/both_paths"]
    assert got["0"] == hf_greedy(models[fam], PROMPTS[0], STEPS), f"{fam} tp={tp}: the inserted row"
    n = len(got["1"])
    assert n == STEPS - 3, (fam, tp, n)  # 40 tokens: 3 chunks of 16, the first token in the 3rd call
    assert got["1"] == hf_greedy(models[fam], PROMPTS[1], n), f"{fam} tp={tp}: the row prefilled by the ragged call"
    if fam in ("qwen2", "gemma2", "gemma3", "gpt_oss"):  # windowed and global layers: the windowed blocks apart
        span = got["window_span"]
        assert span == 12 and got["positions"][1] > 8 + 20 + 4, got  # window + behind (chunk + block) + a block
        assert 0 < max(got["window_held"]) <= span, got
        assert got["window_held"][1] < -(-got["positions"][1] // 4), got  # its first windowed blocks went back
    else:
        assert got["window_span"] == 0


def test_weights_split_as_the_layout_says(run):
    _, res = run
    # wq [L, d, H*hd] = [4, 64, 128] split by column; experts [L, E, d, f] = [4, 8, 64, 48]
    assert res["qwen3_moe/tp4/ep0"]["wq_shard"] == [4, 64, 32]
    assert res["qwen3_moe/tp4/ep0"]["experts_shard"] == [4, 8, 64, 12]  # each expert's units split
    assert res["qwen3_moe/tp4/ep1"]["experts_shard"] == [4, 2, 64, 48]  # two whole experts a chip
    assert res["gpt_oss/tp2/ep1"]["experts_shard"] == [4, 2, 64, 64]


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
