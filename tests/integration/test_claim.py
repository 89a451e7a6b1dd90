"""groups.claim against real Redis: priority order, never more than `count`, and a blocked
claim wakes up for an entry on any of its streams."""
from __future__ import annotations

import asyncio
import time

from tandem_core.bus import groups


async def test_claim_never_returns_more_than_count_and_prefers_earlier_streams(redis_client):
    r = redis_client
    for s in ("a", "b"):
        await groups.ensure_group(r, s, "g")
        for i in range(3):
            await r.xadd(s, {"i": i})
    got = await groups.claim(r, ["a", "b"], "g", "c1", 4, 100)
    assert [c.stream for c in got] == ["a", "a", "a", "b"]
    assert len(await groups.claim(r, ["a", "b"], "g", "c1", 1, 100)) == 1
    assert (await r.xpending("b", "g"))["pending"] == 2  # nothing delivered beyond what was asked


async def test_blocked_claim_wakes_for_any_stream(redis_client, redis_url):
    import redis.asyncio as aioredis

    r = redis_client
    for s in ("hi", "lo"):
        await groups.ensure_group(r, s, "g")
    writer = aioredis.Redis.from_url(redis_url)

    async def later():
        await asyncio.sleep(0.2)
        await writer.xadd("hi", {"x": 1})  # the *first* stream, while the claim blocks

    t0 = time.monotonic()
    task = asyncio.create_task(later())
    got = await groups.claim(r, ["hi", "lo"], "g", "c1", 2, 30_000)
    await task
    await writer.aclose()
    assert [c.stream for c in got] == ["hi"]
    assert time.monotonic() - t0 < 25  # woke on the entry (a liveness check), not at the 30 s timeout
