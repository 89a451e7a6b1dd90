"""Scheduling across the cluster, end to end: bounds hold under a burst, cancellation frees
everything, colocated mode serves the same greedy tokens."""
from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from tests.e2e.conftest import start_local, stop_local, until_quiet

pytestmark = pytest.mark.e2e

SLOTS = 4
KV_BUDGET = 1 << 20  # 1 MiB: four worst-case (512-token) prompts of the tiny preset


@pytest.fixture
def hb_fast():
    old = {k: os.environ.get(k) for k in ("TANDEM_PREFILL_HEARTBEAT_INTERVAL_S", "TANDEM_DECODE_HEARTBEAT_INTERVAL_S")}
    for k in old:
        os.environ[k] = "0.1"
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


async def _sample_registry(base: str, stop: asyncio.Event, samples: list) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=10) as c:
        while not stop.is_set():
            samples.append((await c.get("/admin/cluster")).json())
            await asyncio.sleep(0.05)


async def _one(c: httpx.AsyncClient, i: int) -> dict:
    prompt = f"request number {i} asks for a continuation of this prompt text"  # > 16 tokens: remote prefill
    r = await c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 6,
                                              "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_burst_of_200_with_4_slots_stays_bounded_and_completes(hb_fast):
    cl = start_local("tiny", slots=SLOTS, extra=["--kv-budget-bytes", str(KV_BUDGET)])
    samples: list = []
    try:
        async def run():
            stop = asyncio.Event()
            async with httpx.AsyncClient(base_url=cl.base_url, timeout=10) as c0:
                samples.append((await c0.get("/admin/cluster")).json())  # before the burst
            sampler = asyncio.create_task(_sample_registry(cl.base_url, stop, samples))
            limits = httpx.Limits(max_connections=200)
            async with httpx.AsyncClient(base_url=cl.base_url, timeout=300, limits=limits) as c:
                out = await asyncio.gather(*[_one(c, i) for i in range(200)])
            await asyncio.sleep(0.5)  # > 2 heartbeats: the last samples show the finished counters
            stop.set()
            await sampler
            return out

        results = asyncio.run(run())
    finally:
        stop_local(cl.proc)
    assert len(results) == 200
    assert all(r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 6
               for r in results)
    decoded = []  # the decode pod's token counter in each sample
    for snap in samples:
        for w in snap["workers"]:
            assert 0 <= w["free_slots"] <= w["slots"]
            if w["role"] == "prefill":
                assert w["held_kv_bytes"] <= KV_BUDGET
            else:
                decoded.append(w["extra"]["tokens"])
        assert snap["queues"]["admission_backlog"] <= 200
    # The samples spanned the burst: the decode pod's 200 x 5 tokens (index 0 comes from the
    # prefill pod) happened between the first sample and the last. (A busy slot is a poor witness:
    # the tiny model decodes 5 tokens in a few ms, so slots sit free between prefills.)
    assert len(samples) > 5 and decoded and max(decoded) - min(decoded) >= 200 * 5


async def _start_and_drop(base: str, n_events: int, model: str) -> str:
    body = {"model": model, "prompt": "x" * 40, "max_tokens": 400, "stream": True, "ignore_eos": True,
            "temperature": 0}
    async with httpx.AsyncClient(base_url=base, timeout=60) as c:
        async with c.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, (await resp.aread())[:300]  # (a 404 once passed as "cancelled")
            rid = resp.headers.get("x-request-id", "")
            seen = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= n_events:
                        break  # the client goes away mid-stream
    return rid


def test_disconnect_cancels_and_frees_slots_and_kv(local_cluster):
    before = until_quiet(local_cluster.base_url)

    async def run():
        # Six long requests for four slots: some are decoding, some wait in admission/ready.
        tasks = [asyncio.create_task(_start_and_drop(local_cluster.base_url, 3 if i < 4 else 1, local_cluster.model))
                 for i in range(6)]
        return await asyncio.gather(*tasks)

    asyncio.run(run())
    # every pod idle again (slots free, KV freed, nothing queued, counters settled) ...
    after = until_quiet(local_cluster.base_url)
    # ... because they were cancelled, not because they ran to their end: the decode pod wrote a
    # cancelled finish for those it held, and decoded far fewer than 6 x 399 tokens
    assert after["cancelled"] > before["cancelled"], after
    assert after["tokens"] - before["tokens"] < 6 * 399 // 2, after


def _decode_extra(base: str) -> dict:
    workers = httpx.get(base + "/admin/cluster", timeout=10).json()["workers"]
    dec = [w for w in workers if w["role"] == "decode"]
    assert len(dec) == 1, workers
    return {**dec[0]["extra"], "free": dec[0]["free_slots"] == dec[0]["slots"]}


def _until_decode(base: str, settled, timeout_s: float = 30) -> dict:
    """The decode pod's heartbeat counters once `settled(extra)` (a bound on the wait only)."""
    deadline = time.monotonic() + timeout_s
    while True:
        extra = _decode_extra(base)
        if settled(extra) or time.monotonic() > deadline:
            return extra
        time.sleep(0.1)


LONG_STREAM = 460  # tokens asked for: the local cluster's context (512) less the prompt


def test_a_dropped_stream_stops_the_decode_pod_within_a_step(local_cluster):
    """Cancellation asserted at the worker, not by slots that natural completion frees too: a long
    stream dropped after 3 tokens ends at the decode pod with a `cancelled` finish (its cancel
    counter), long before the tokens it asked for (its token counter), and no more than the step
    in flight after the cancel reached the engine (its cancel lag)."""
    base = local_cluster.base_url
    before = until_quiet(base)

    async def drop():
        body = {"model": local_cluster.model, "prompt": "x" * 40, "max_tokens": LONG_STREAM, "stream": True,
                "ignore_eos": True,
                "temperature": 0}
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            async with c.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                seen = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                        if seen >= 3:
                            return  # the client goes away mid-stream

    asyncio.run(drop())
    after = _until_decode(base, lambda x: x["free"] and x["cancelled"] > before["cancelled"]
                          and x["tokens"] > before["tokens"])
    decoded = after["tokens"] - before["tokens"]
    assert after["cancelled"] - before["cancelled"] == 1, f"the decode pod wrote no cancelled finish: {after}"
    assert decoded < LONG_STREAM - 1, f"the decode pod ran the dropped stream to its end ({decoded} tokens)"
    # the cancel reached the engine while it ran, and it stopped within the call in flight: one
    # step, or with multi-step decode the call being read and the one dispatched after it
    from tandem_core.settings import EngineConfig
    bound = 2 * EngineConfig().steps_per_dispatch
    assert after["cancel_lag_tokens"] <= bound, f"{after['cancel_lag_tokens']} tokens decoded after the cancel arrived"


def test_colocated_mode_gives_the_engines_greedy_tokens():
    from tests.e2e.test_skeleton import _reference_greedy

    from tandem_core.models import resolve_model
    from tandem_core.tokenizer import load_tokenizer

    cl = start_local("tiny", slots=2, extra=["--colocated"])
    try:
        tok = load_tokenizer(resolve_model("tiny"))
        for prompt in ("short", "a somewhat longer prompt that is over sixteen tokens"):
            ref = tok.decode(_reference_greedy("tiny", cl.max_len, prompt, 20))
            got = httpx.post(cl.base_url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0}).json()
            assert got["choices"][0]["text"] == ref
        deadline = time.monotonic() + 10  # the registry lags by up to a heartbeat
        while True:
            workers = httpx.get(cl.base_url + "/admin/cluster", timeout=10).json()["workers"]
            assert [w["role"] for w in workers] == ["decode"]
            if workers[0]["extra"]["local_prefills"] >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert workers[0]["extra"]["local_prefills"] >= 2
    finally:
        stop_local(cl.proc)


def test_route_decisions_are_a_metric_with_a_reason(local_cluster):
    httpx.post(local_cluster.base_url + "/v1/completions", timeout=60,
               json={"model": "builtin", "prompt": "x", "max_tokens": 2}).raise_for_status()
    httpx.post(local_cluster.base_url + "/v1/completions", timeout=60,
               json={"model": "builtin", "prompt": "def f(x):\n    return x * 2\n" * 4, "max_tokens": 2}
               ).raise_for_status()
    text = httpx.get(local_cluster.base_url + "/metrics", timeout=10).text
    assert 'tandem_route_total{reason="short_prompt",route="local"}' in text
    assert 'tandem_route_total{reason="remote",route="remote"}' in text
