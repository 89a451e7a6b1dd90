"""A decode pod whose KV is paged, end to end: `tandem local --kv-layout paged --kv-blocks 16`
(16 blocks of 16 positions: 256 positions for 4 rows of a 128-position context), ten concurrent
greedy requests that each grow to ~100 positions (more than the 4 rows: the rows stay full while
any wait, so the pool runs out even when the prefills reach the pod a little apart; with six it
did not, once, in a full run on 2026-12-08). The pool runs out mid-generation, the decode
pod hands the newest requests back (resumed from their streamed tokens through the prefill pod),
and every client still gets exactly the text of the engine alone; /admin/cluster shows the
blocks and the hand-backs."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.e2e.conftest import start_local, stop_local

pytestmark = pytest.mark.e2e

MAX_LEN = 128
MAX_TOKENS = 80
PROMPTS = [f"paged request {i}: keep on writing" for i in range(10)]


def _decode(base: str) -> dict:
    workers = httpx.get(base + "/admin/cluster", timeout=10).json()["workers"]
    return next(w for w in workers if w["role"] == "decode")


def test_paged_decode_pod_hands_the_newest_back_and_every_stream_is_exact():
    from tests.e2e.test_skeleton import _reference_greedy

    from tandem_core.models import resolve_model
    from tandem_core.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model("tiny"))
    want = [tok.decode(_reference_greedy("tiny", MAX_LEN, p, MAX_TOKENS)) for p in PROMPTS]
    # (a paged decode pod's warm-up compiled for minutes on 2 shared cores: the persistent compile
    # cache makes later starts quick)
    cl = start_local("tiny", slots=4, max_len=MAX_LEN, timeout_s=900,
                     extra=["--kv-blocks", "16", "--ready-timeout", "880"])
    try:
        # the prefill pod's batched shapes compiled first, so the prompts are prefilled together
        # and reach the decode pod at once (prefilled one by one they could be served one after
        # another, and the pool never run out: seen twice in a full e2e run)
        deadline = time.monotonic() + 300
        while any(w["role"] == "prefill" and w["extra"]["batch_compiles"]["done"] < w["extra"]["batch_compiles"]["total"]
                  for w in httpx.get(cl.base_url + "/admin/cluster", timeout=10).json()["workers"]):
            assert time.monotonic() < deadline, "the prefill pod's batched prefills did not compile in 300 s"
            time.sleep(0.3)

        async def run() -> list[str]:
            async with httpx.AsyncClient(base_url=cl.base_url, timeout=180) as c:
                async def one(p: str) -> str:
                    r = await c.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS,
                                                              "temperature": 0})
                    assert r.status_code == 200, r.text
                    return r.json()["choices"][0]["text"]
                return await asyncio.gather(*(one(p) for p in PROMPTS))

        got = asyncio.run(run())
        for p, g, w in zip(PROMPTS, got, want):
            assert g == w, f"{p!r}: got {g!r}, the engine alone gives {w!r}"
        deadline = time.monotonic() + 10  # the registry lags by a heartbeat
        while True:
            dec = _decode(cl.base_url)
            if dec["extra"].get("handed_back_for_blocks") or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        kv = dec["extra"]["kv"]
        assert kv["layout"] == "paged" and kv["blocks_total"] == 16 and kv["block_size"] == 16
        assert dec["extra"]["handed_back_for_blocks"] >= 1, "the pool never ran out: nothing tested"
        assert any("handing back the newest" in line for line in cl.log)
    finally:
        stop_local(cl.proc)
