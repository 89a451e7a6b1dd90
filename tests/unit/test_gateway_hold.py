"""gateway/hold.py: a request waits for an unreachable Redis within its bounds (time, the request's
deadline, how many wait at once) and gets a 503 with Retry-After past them; `degraded` tells the
first redis_hold_s of an outage from a longer one. No sockets: the attempts fail by themselves."""
from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.hold import RedisHold
from tandem_core.errors import ServiceUnavailable


def hold(**kw) -> RedisHold:
    args = dict(hold_s=2.0, max_held=4, retry_after_s=1.0, down_errors=(RedisConnectionError,), poll_s=0.01)
    return RedisHold(**{**args, **kw})


def failing(times: int):
    calls = []

    async def attempt():
        calls.append(time.monotonic())
        if len(calls) <= times:
            raise RedisConnectionError("Connection refused")
        return "enqueued"
    return attempt, calls


async def test_a_request_waits_through_an_outage_and_goes_on():
    h = hold()
    attempt, calls = failing(5)
    assert await h.call(attempt) == "enqueued"
    assert len(calls) == 6 and h.holding == 0 and h.held_total == 1 and not h.degraded


async def test_past_the_hold_the_client_gets_503_with_retry_after():
    h = hold(hold_s=0.1)
    attempt, _ = failing(10**6)
    with pytest.raises(ServiceUnavailable, match=r"Redis is unreachable.*waited .*redis_hold_s 0.1") as err:
        await h.call(attempt)
    assert err.value.retry_after_s == 1.0 and h.holding == 0


async def test_the_requests_own_deadline_ends_the_wait_first():
    h = hold(hold_s=30)
    attempt, _ = failing(10**6)
    t0 = time.monotonic()
    with pytest.raises(ServiceUnavailable):
        await h.call(attempt, deadline_ts=time.time() + 0.1)
    assert time.monotonic() - t0 < 5


async def test_past_max_held_a_request_fails_at_once():
    h = hold(max_held=1, hold_s=5)
    first, _ = failing(10**6)
    waiting = asyncio.create_task(h.call(first))
    await asyncio.sleep(0.05)
    assert h.holding == 1 and h.degraded
    second, calls = failing(10**6)
    with pytest.raises(ServiceUnavailable, match=r"1 requests already wait for it.*redis_hold_max 1"):
        await h.call(second)
    assert len(calls) == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert h.holding == 0


async def test_other_errors_are_not_held():
    h = hold()

    async def bad():
        raise ValueError("not a Redis outage")

    with pytest.raises(ValueError):
        await h.call(bad)
    assert h.held_total == 0 and not h.degraded


def test_degraded_only_for_the_first_hold_s_of_an_outage():
    h = hold(hold_s=0.05)
    h.note_down()
    assert h.degraded
    time.sleep(0.06)
    assert not h.degraded
    h.note_ok()
    assert not h.degraded and h.down_since is None
