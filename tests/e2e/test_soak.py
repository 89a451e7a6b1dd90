"""A bounded soak (one minute by default; TANDEM_SOAK_S=600 for a longer one): rounds of 320
mixed requests, 24 concurrent, against the whole cluster.
Every request finishes (every streamed event parsed: an in-band error event is a failure); no process's resident memory keeps growing (peak of the second half
within the first half's peak plus a margin, and under a fixed ceiling); and once finished token
streams have lingered their TTL, Redis holds nothing for the finished requests."""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time

import httpx
import pytest
import redis

from tandem_core import keys
from tests.e2e.conftest import start_local, stop_local
from tests.e2e.fault_inject import launcher_children

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

N, CONCURRENCY, FINISHED_TTL = 320, 24, 2
SOAK_S = float(os.environ.get("TANDEM_SOAK_S", "60"))  # measured phase: keeps sending for this long
CEILING = {"gateway": 700 << 20, "prefill_svc": 1500 << 20, "decode_svc": 1500 << 20}


def _rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def streamed_usage(text: str) -> int:
    """Every event of one streamed completion, parsed: no in-band error event (a 200 whose stream
    ends with `data: {"error": ...}` and then `[DONE]` is a failed request, not a served one), one
    `length` finish (the soak asks with ignore_eos), `[DONE]` last; its completion tokens (usage)."""
    # SSE lines end only at CR, LF or CRLF: str.splitlines would also cut at U+2028, U+0085, ...,
    # which the model's text may hold unescaped inside a JSON string
    events = [line[6:] for line in re.split(r"\r\n|\r|\n", text) if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"the stream did not end with [DONE]: {text[-300:]}"
    chunks = [json.loads(e) for e in events[:-1]]  # every event is JSON
    errors = [c["error"] for c in chunks if "error" in c]
    assert not errors, f"the stream carried an error event: {errors}"
    finishes = [ch["finish_reason"] for c in chunks for ch in c.get("choices") or [] if ch.get("finish_reason")]
    assert finishes == ["length"], f"finish reasons {finishes}"
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage) == 1, f"usage events {usage}"
    return usage[0]["completion_tokens"]


async def _load(base: str, rng: random.Random, duration_s: float = 0.0) -> list[dict]:
    """N requests, CONCURRENCY at a time; with `duration_s`, rounds of N until that time is up."""
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int, c: httpx.AsyncClient) -> dict:
        body = {"model": "tiny", "prompt": "soak " * rng.randint(1, 60), "max_tokens": rng.randint(1, 40),
                "temperature": rng.choice([0, 0.8]), "seed": i, "ignore_eos": True, "stream": rng.random() < 0.5}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        async with sem:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            if body["stream"]:
                return {"n": body["max_tokens"], "got": streamed_usage(r.text), "stream": True}
            return {"n": body["max_tokens"], "got": r.json()["usage"]["completion_tokens"]}

    out: list[dict] = []
    end = time.monotonic() + duration_s
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=64)) as c:
        while True:
            out += await asyncio.gather(*[one(len(out) + i, c) for i in range(N)])
            if time.monotonic() >= end:
                return out


def test_bounded_soak():
    env = {f"TANDEM_{s}_TOKEN_FINISHED_TTL_S": str(FINISHED_TTL) for s in ("PREFILL", "DECODE")}
    os.environ.update(env)
    try:
        cl = start_local("tiny", slots=4)
    finally:
        for k in env:
            os.environ.pop(k)
    samples: list[tuple[float, int, int]] = []  # (time, pid, rss)
    try:
        procs = launcher_children(cl.proc.pid)
        assert sorted(set(procs.values())) == ["decode_svc", "gateway", "prefill_svc"]

        async def run():
            task = asyncio.create_task(_load(cl.base_url, random.Random(0), SOAK_S))
            while not task.done():
                samples.extend((time.monotonic(), pid, _rss(pid)) for pid in procs)
                await asyncio.sleep(0.25)
            return await task

        # Warm-up first (compiles every bucket the load will hit), then measure.
        asyncio.run(_load(cl.base_url, random.Random(1)))
        results = asyncio.run(run())
        assert len(results) >= N
        for r in results:
            assert r["got"] == r["n"], r
        time.sleep(FINISHED_TTL + 1.5)
        url = httpx.get(cl.base_url + "/admin/cluster", timeout=10).json()
        assert url["queues"]["admission_backlog"] == 0 and url["queues"]["ready"] == 0
        log = "".join(cl.log)
        rurl = next(line.split("url=")[1].split()[0] for line in log.splitlines() if "redis pid=" in line)
        r = redis.Redis.from_url(rurl)
        leftovers = [k.decode() for k in r.scan_iter(count=1000)
                     if any(part in k for part in (b":tok:", b":cancel:", b":resume:"))]
        running = {k.decode(): r.hlen(k) for k in r.scan_iter(match=keys.RUNNING_PATTERN)}
        r.close()
    finally:
        stop_local(cl.proc)
    assert not leftovers, f"{len(leftovers)} keys left for finished requests, e.g. {leftovers[:5]}"
    assert all(v == 0 for v in running.values()), running
    mid = (samples[0][0] + samples[-1][0]) / 2
    for pid, name in procs.items():
        first = max(rss for t, p, rss in samples if p == pid and t <= mid)
        second = max(rss for t, p, rss in samples if p == pid and t > mid)
        assert max(first, second) < CEILING[name], f"{name} peak RSS {max(first, second) >> 20} MiB"
        assert second <= first * 1.15 + (30 << 20), f"{name} RSS grew: {first >> 20} -> {second >> 20} MiB"
