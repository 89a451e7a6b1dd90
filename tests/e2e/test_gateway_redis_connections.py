"""3,000 concurrent streams against one gateway, all served, with at most 64 Redis connections from
that gateway (issue 31): `tandem local` (the built-in model, real services, the embedded Redis),
the gateway with its default settings (but the time-to-first-token deadline, see below). Every connection of a gateway is named `tandem-gateway`
(CLIENT SETNAME), so CLIENT LIST on the embedded Redis counts the gateway's alone, sampled all
through the run and once after it (a pool keeps what it opened, so the count after is its peak).

With the old default (`TANDEM_GATEWAY_REDIS__MAX_CONNECTIONS=1024` in the environment, which
`tandem local` passes through) the same run opens hundreds and this test fails.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import Counter

import httpx
import redis

from tests.e2e.conftest import start_local, stop_local

STREAMS = 3000
BOUND = 64  # the default redis.max_connections
NAME = "tandem-gateway"  # gateway/app.py REDIS_CLIENT_NAME


def _redis_url(log: list[str]) -> str:
    for line in log:
        m = re.search(r"redis pid=\d+ url=(redis://\S+)", line)
        if m:
            return m.group(1)
    raise AssertionError("no embedded Redis url in tandem local's log:\n" + "".join(log[-20:]))


def _gateway_connections(url: str) -> int:
    with redis.Redis.from_url(url) as r:
        return sum(1 for c in r.client_list() if c.get("name") == NAME)


async def _one(client: httpx.AsyncClient, i: int, open_now: list[int]) -> str | None:
    """None when the stream ended with [DONE] after text and no error event; else what went wrong."""
    body = {"model": "builtin", "prompt": f"stream {i}", "max_tokens": 2, "temperature": 0, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            open_now[0] += 1
            open_now[1] = max(open_now[1], open_now[0])
            try:
                done, chunks = False, 0
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            return f"error event: {chunk['error']}"
                        chunks += 1
                return None if done and chunks else f"ended without [DONE] after {chunks} chunks"
            finally:
                open_now[0] -= 1
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


def test_3000_streams_on_one_gateway_within_64_redis_connections():
    # The time-to-first-token predictor's 503 (3,000 queued x the prefill time the pod reports,
    # past first_token_timeout_s, 120 s) is early rejection working, not what this test is about:
    # on a busy machine it refused some of the burst, so its deadline is set out of its way.
    c = start_local(slots=16, timeout_s=300, env={"TANDEM_GATEWAY_FIRST_TOKEN_TIMEOUT_S": "900"})
    try:
        url = _redis_url(c.log)
        samples: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.25):
                try:
                    samples.append(_gateway_connections(url))
                except redis.RedisError:
                    pass  # a sample lost; the count after the run is the pool's peak anyway

        async def run() -> tuple[list[str | None], int]:
            open_now = [0, 0]  # streams open now, the most open at once
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=c.base_url, timeout=600, limits=limits) as client:
                out = await asyncio.gather(*(_one(client, i, open_now) for i in range(STREAMS)))
            return out, open_now[1]

        w = threading.Thread(target=watch, daemon=True)
        w.start()
        try:
            results, most_open = asyncio.run(run())
        finally:
            stop.set()
            w.join()
        after = _gateway_connections(url)
        failed = [r for r in results if r is not None]
        peak = max(samples + [after])
        print(f"gateway Redis connections: peak {peak}, after {after}; streams open at once: {most_open}; "
              f"not served: {len(failed)} {Counter(f[:90] for f in failed).most_common(3)}")
        assert not failed, f"{len(failed)} of {STREAMS} not served, e.g. {sorted(set(failed))[:5]}"
        # the load was really concurrent: most streams were open at once, waiting in admission
        assert most_open >= STREAMS // 2, most_open
        assert peak <= BOUND, (f"the gateway held {peak} Redis connections at {STREAMS} streams (bound {BOUND}); "
                               f"samples {samples[-20:]}")
        assert after > 0  # the count does see the gateway's connections (they are named)
    finally:
        stop_local(c.proc)
