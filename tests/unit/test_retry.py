"""tandem_core/retry.py, the one retry helper, and what tandem_core/bus/conn.py counts as "Redis is
down": redis-py's connection and timeout errors (and the Sentinel/Cluster transients), never a
builtin OSError or ConnectionError raised by the caller's own work. No sockets: the calls fail by
themselves."""
from __future__ import annotations

import asyncio
import logging

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tandem_core.bus import conn
from tandem_core.retry import Backoff, retry


def failing(times: int, error: BaseException):
    calls = []

    async def fn():
        calls.append(1)
        if len(calls) <= times:
            raise error
        return "ok"
    return fn, calls


FAST = Backoff.fixed(0.001)


async def test_transient_errors_are_retried_until_success_and_logged_once(caplog):
    fn, calls = failing(5, RedisConnectionError("Connection refused"))
    with caplog.at_level(logging.INFO, logger="tandem_core.retry"):
        assert await retry(fn, "the write", transient=conn.REDIS_DOWN, timeout_s=5, backoff=FAST) == "ok"
    assert len(calls) == 6
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "the write failed (ConnectionError: Connection refused); retrying" in warnings[0].message
    assert any("the write succeeded after 5 failed tries" in r.message for r in caplog.records)


async def test_other_errors_propagate_at_once():
    fn, calls = failing(1, ResponseError("OOM command not allowed"))
    with pytest.raises(ResponseError):
        await retry(fn, "the write", transient=conn.REDIS_DOWN, timeout_s=5, backoff=FAST)
    assert len(calls) == 1


async def test_attempts_bound_raises_the_last_transient_error(caplog):
    fn, calls = failing(10**6, RedisTimeoutError("Timeout reading from socket"))
    with pytest.raises(RedisTimeoutError), caplog.at_level(logging.WARNING, logger="tandem_core.retry"):
        await retry(fn, "the publish", transient=conn.REDIS_DOWN, attempts=3, backoff=FAST)
    assert len(calls) == 3
    assert "the publish failed 3 times" in caplog.records[-1].message and "giving up" in caplog.records[-1].message


async def test_deadline_bounds_the_retries():
    fn, calls = failing(10**6, RedisConnectionError("down"))
    loop = asyncio.get_running_loop()
    with pytest.raises(RedisConnectionError):
        await retry(fn, "x", transient=conn.REDIS_DOWN, deadline=loop.time() + 0.05, backoff=Backoff.fixed(0.01))
    assert 1 < len(calls) < 1000


async def test_on_retry_runs_after_each_failure_and_may_stop_the_retries():
    seen = []

    async def on_retry(e, n):
        seen.append(n)
        if n == 2:
            raise ValueError("enough")

    fn, calls = failing(10**6, RedisConnectionError("down"))
    with pytest.raises(ValueError, match="enough"):
        await retry(fn, "x", transient=conn.REDIS_DOWN, backoff=FAST, on_retry=on_retry)
    assert seen == [1, 2] and len(calls) == 2


def test_backoff_grows_to_its_cap():
    b = Backoff(first_s=0.1, max_s=1.0, factor=2.0)
    assert [b.delay(n) for n in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert Backoff.fixed(0.25).delay(10) == 0.25


@pytest.mark.parametrize("error", [OSError("disk full"), ConnectionError("the prefill's own socket"),
                                   ConnectionResetError("peer reset"), FileNotFoundError("weights.bin")])
async def test_builtin_os_errors_are_not_redis_being_down(error):
    """An OSError of the caller's own work fails at once: retried as an outage it would stall the
    prefill pod's claim loop until the request's deadline plus abandoned_after_s."""
    assert not isinstance(error, conn.REDIS_DOWN)
    fn, calls = failing(1, error)
    with pytest.raises(type(error)):
        await conn.retry_redis(fn, "x", timeout_s=5)
    assert len(calls) == 1


@pytest.mark.parametrize("error", [RedisConnectionError("Connection refused"), RedisTimeoutError("Timeout")])
async def test_redis_py_connection_and_timeout_errors_are_redis_being_down(error):
    assert isinstance(error, conn.REDIS_DOWN)
    fn, calls = failing(2, error)
    assert await conn.retry_redis(fn, "x", timeout_s=5) == "ok"
    assert len(calls) == 3


async def test_a_refused_connection_from_redis_py_is_its_connection_error():
    """What a stopped Redis really raises through redis-py is its own ConnectionError (it wraps the
    socket's OSError), so narrowing REDIS_DOWN loses no outage."""
    import socket

    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # no retries: redis-py's default backs off between them (4 s here) and raises the same error
    r = aioredis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    try:
        with pytest.raises(conn.REDIS_DOWN) as err:
            await r.ping()
        assert isinstance(err.value, RedisConnectionError)
    finally:
        await r.aclose()
