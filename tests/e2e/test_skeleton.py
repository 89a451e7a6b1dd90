"""One request through gateway -> Redis -> prefill -> gRPC KV -> decode -> client, for real."""
from __future__ import annotations

import asyncio
import re
import time

import httpx
import numpy as np
import openai
import pytest

from tandem_core.models import resolve_model
from tandem_core.tokenizer import load_tokenizer
from tests.e2e.sse import sse_chunks

pytestmark = pytest.mark.e2e

PROMPTS = ["def main():\n    ", "The quick brown fox", "import os\nimport sys\n", "class Point:\n"]


def _client(local_cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=local_cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_plain_and_streamed_completion_give_the_same_text(local_cluster):
    c = _client(local_cluster)
    plain = c.completions.create(model=local_cluster.model, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    streamed = c.completions.create(model=local_cluster.model, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                    stream=True)
    text = "".join(ch.choices[0].text for ch in streamed if ch.choices)
    assert plain.choices[0].text == text
    assert plain.choices[0].finish_reason in ("stop", "length")
    assert 1 <= plain.usage.completion_tokens <= 24 and plain.usage.prompt_tokens > 0


async def _stream_indices(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[list[int], str]:
    body = {"model": "builtin", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.8,
            "seed": 7, "ignore_eos": True}
    ids, finish = [], None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for event_id, chunk in sse_chunks(resp):
            if chunk["choices"]:
                ids.append(event_id)
                finish = chunk["choices"][0]["finish_reason"] or finish
    return ids, finish


def test_sixteen_concurrent_streams_every_index_exactly_once(local_cluster):
    async def run():
        async with httpx.AsyncClient(base_url=local_cluster.base_url, timeout=180) as client:
            jobs = [_stream_indices(client, f"{PROMPTS[i % 4]}{i}", 10 + i) for i in range(16)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    for i, (ids, finish) in enumerate(results):
        assert ids == list(range(10 + i)), f"request {i}: indices {ids}"
        assert finish == "length"


def _reference_greedy(model: str, max_len: int, prompt: str, max_tokens: int) -> list[int]:
    """The engine alone, one process, one slot: prefill then generate until EOS or max_tokens."""
    from tandem_core.types import SamplingParams
    from tandem_engine import load_engine

    info = resolve_model(model)
    tok = load_tokenizer(info)
    eng = load_engine(model, slots=1, max_len=max_len)
    ids = tok.encode(prompt)
    prefix = eng.prefill(ids, SamplingParams())
    out = [prefix.first_token]
    state = eng.insert(prefix, eng.init_state(), 0, SamplingParams())
    while len(out) < max_tokens and out[-1] not in info.eos_token_ids:
        state, toks = eng.generate(state)
        out.append(int(np.asarray(toks)[0]))
    return out


def test_greedy_through_the_cluster_equals_single_process_engine(local_cluster):
    tok = load_tokenizer(resolve_model(local_cluster.model))
    c = _client(local_cluster)
    for prompt in PROMPTS[:3]:
        ref = _reference_greedy(local_cluster.model, local_cluster.max_len, prompt, 32)
        ref_text = tok.decode([t for t in ref if t not in resolve_model(local_cluster.model).eos_token_ids])
        got = c.completions.create(model=local_cluster.model, prompt=prompt, max_tokens=32, temperature=0)
        assert got.choices[0].text == ref_text, f"prompt {prompt!r}"
        assert got.usage.completion_tokens == len(ref)


def test_cluster_admin_lists_workers(local_cluster):
    workers = httpx.get(local_cluster.base_url + "/admin/cluster", timeout=10).json()["workers"]
    roles = sorted(w["role"] for w in workers)
    assert roles == ["decode", "prefill"]
    for w in workers:
        assert {"id", "pid", "address", "slots", "free_slots", "held_kv_bytes", "heartbeat_age_s"} <= set(w)
        assert w["heartbeat_age_s"] < 10


def _background_compiles(cluster, role: str, field: str, logged: str) -> tuple[dict, list[str]]:
    """Wait (180 s at most) until the `role` pod's heartbeat field `field` (done of total) is
    done and its log has said so (`logged`: a pattern whose group is the count). Returns (the
    field, the counts the log gave)."""
    deadline = time.monotonic() + 180
    while True:
        (pod,) = [w for w in httpx.get(cluster.base_url + "/admin/cluster", timeout=10).json()["workers"]
                  if w["role"] == role]
        counts = pod["extra"][field]
        assert 0 <= counts["done"] <= counts["total"], counts
        said = [m for line in cluster.log for m in re.findall(logged, line)]
        if counts["done"] == counts["total"] and said:
            return counts, said
        assert time.monotonic() < deadline, f"still compiling after 180 s: {counts}, logged: {said}"
        time.sleep(0.5)


def test_the_prefill_pod_reports_its_batched_compiles(local_cluster):
    """The prefill pod compiles its batched prefill shapes after it reports ready; its heartbeat
    says how far (`batch_compiles`: what bench/systems.py waits for before measuring), and the
    count is the one its log gives when they are done."""
    b, said = _background_compiles(local_cluster, "prefill", "batch_compiles",
                                   r"batched prefills compiled in .* \((\d+) shapes")
    assert b["total"] == int(said[0]) > 0 and b["failed"] == 0, (b, said)


def test_the_decode_pod_compiles_its_masked_steps_after_ready_and_says_so(local_cluster):
    """A decode pod's warm-up leaves the grammar-masked step variants to its engine's idle time
    after it reports ready (decode_svc/loop.py `late_warm`); its heartbeat counts them
    (`late_compiles`), one per batch bucket, and its log says when they are done."""
    late, said = _background_compiles(local_cluster, "decode", "late_compiles",
                                      r"the (\d+) step variants left to idle time")
    warmed = [m for line in local_cluster.log for m in re.findall(r"(\d+) decode step variants; KV", line)]
    assert late["total"] == int(said[0]) > 0 and warmed and int(warmed[0]) == 2 * late["total"], (late, said, warmed)
