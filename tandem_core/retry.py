"""The one way Tandem retries an operation: a deadline, a backoff, a named set of transient errors,
and the same log lines everywhere.

Every path that waits out a Redis restart or failover (tandem_core/bus/conn.py `retry_redis`, the
decode pod's token publish, the prefill pod's commit of an entry, the gateway's hold of a new
request and its readmission after a Redis change) calls `retry`, so "how long", "how often" and
"what counts as an outage" are answered in one place:
- only an error of `transient` is retried; anything else propagates at once (a bug, a refused
  write or a bad request is not waited out);
- the last transient error is raised when `attempts` or the deadline runs out: the caller decides
  what ending the request gets (resumed elsewhere, a clear error, a 503);
- the first failure logs a warning naming `what`, later ones at most every `LOG_EVERY_S`, and the
  success after failures logs how long it took.
This module knows nothing of Redis: callers pass their own `transient` tuple (conn.REDIS_DOWN).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
LOG_EVERY_S = 10.0  # while an outage lasts, one "still failing" line per this many seconds
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backoff:
    """Pause before retry n (0-based): first_s * factor**n, at most max_s."""

    first_s: float = 0.1
    max_s: float = 2.0
    factor: float = 2.0

    def delay(self, n: int) -> float:
        return min(self.max_s, self.first_s * self.factor ** min(n, 64))

    @classmethod
    def fixed(cls, s: float) -> Backoff:
        return cls(first_s=s, max_s=s, factor=1.0)


async def retry(fn: Callable[[], Awaitable[T]], what: str, *, transient: tuple[type[BaseException], ...],
                timeout_s: float | None = None, deadline: float | None = None, attempts: int | None = None,
                backoff: Backoff = Backoff(), log: logging.Logger | None = None, level: int = logging.WARNING,
                on_retry: Callable[[BaseException, int], Awaitable[None] | None] | None = None) -> T:
    """`await fn()` until it returns, retrying errors of `transient` only.

    Bounds (any that is set ends the retries; the last transient error is then raised):
    `timeout_s` from now, `deadline` (time.monotonic()), `attempts` calls in all. With none set it
    retries until it succeeds: only for a caller that has nothing else it could do meanwhile and
    says so. `level`: of the "failed; retrying" and "giving up" lines (a path that retries per
    request, as the gateway's hold, logs them at DEBUG and reports the outage itself). `on_retry(error, n)` runs after the n-th failure (1-based), before the pause; it may
    raise to stop the retries (the gateway's hold does, past its bound of waiting requests)."""
    log = log or _log
    start = time.monotonic()
    end = start + timeout_s if timeout_s is not None else None
    if deadline is not None:
        end = deadline if end is None else min(end, deadline)
    n, last_log = 0, 0.0
    while True:
        try:
            out = await fn()
        except transient as e:
            n += 1
            now = time.monotonic()
            if (attempts is not None and n >= attempts) or (end is not None and now >= end):
                log.log(level, "%s failed %d times over %.1fs (%s: %s); giving up", what, n, now - start,
                            type(e).__name__, e)
                raise
            if n == 1 or now - last_log >= LOG_EVERY_S:
                log.log(level, "%s failed (%s: %s); retrying%s", what, type(e).__name__, e,
                            "" if n == 1 else f" (try {n}, {now - start:.1f}s so far)")
                last_log = now
            if on_retry is not None:
                got = on_retry(e, n)
                if asyncio.iscoroutine(got):
                    await got
            pause = backoff.delay(n - 1)
            if end is not None:
                pause = max(0.0, min(pause, end - time.monotonic()))
            await asyncio.sleep(pause)
            continue
        if n:
            log.log(min(level, logging.INFO), "%s succeeded after %d failed tries (%.1fs)", what, n, time.monotonic() - start)
        return out
