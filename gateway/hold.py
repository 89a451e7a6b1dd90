"""Riding through a Redis outage at the front door: a new request waits for Redis, not fails.

A Redis pod restart or a Sentinel failover takes a second to several; a request that arrives then
should cost its client that wait, not a 503. `RedisHold.call` retries the request's admission
(backlog read, checks, enqueue) while Redis does not answer, for at most `hold_s` and never past
the request's own deadline, and only for `max_held` requests at once on this replica; past either
bound the client gets the 503 it got before, with Retry-After. The enqueue it retries is
idempotent (tandem_core/bus/admission.py `enqueue`: a marker keyed by request id, set in the same script
as the XADD), so a reply lost on a dying connection never enqueues a request twice.

`degraded`: Redis has failed to answer for less than `hold_s` (`/readyz` says so, and stays 200
so a load balancer keeps sending: those requests are held); after that `/readyz` says not ready.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Awaitable, Callable, TypeVar

from tandem_core.errors import ServiceUnavailable
from tandem_core.retry import Backoff, retry

T = TypeVar("T")
log = logging.getLogger(__name__)


class RedisHold:
    def __init__(self, hold_s: float, max_held: int, retry_after_s: float, down_errors: tuple,
                 poll_s: float = 0.25) -> None:
        self.hold_s = hold_s
        self.max_held = max_held
        self.retry_after_s = retry_after_s
        self.down_errors = down_errors
        self.poll_s = poll_s
        self.holding = 0  # requests waiting for Redis right now
        self.held_total = 0  # requests that ever waited (and then went on or failed)
        self.down_since: float | None = None  # monotonic time of the first failure of this outage

    def note_ok(self) -> None:
        self.down_since = None

    def note_down(self) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()

    @property
    def degraded(self) -> bool:
        return self.down_since is not None and time.monotonic() - self.down_since < self.hold_s

    async def call(self, attempt: Callable[[], Awaitable[T]], deadline_ts: float | None = None) -> T:
        """`attempt()`, retried while it fails with a down error, within the bounds above
        (tandem_core/retry.py: `hold_s` and the request's deadline; the room checked at the first
        failure)."""
        start, held = time.monotonic(), False

        def on_retry(e: BaseException, _n: int) -> None:
            nonlocal held
            self.note_down()
            if not held:
                self._check_room(e)
                self.holding, self.held_total, held = self.holding + 1, self.held_total + 1, True

        try:
            try:
                out = await retry(attempt, "admission while Redis is down", transient=self.down_errors,
                                  deadline=start + self._time_left(start, deadline_ts), backoff=Backoff.fixed(self.poll_s),
                                  log=log, level=logging.DEBUG, on_retry=on_retry)
            except self.down_errors as e:
                self.note_down()
                raise ServiceUnavailable(
                    f"Redis is unreachable: {e}; this request waited {time.monotonic() - start:.1f}s "
                    f"for it (redis_hold_s {self.hold_s:g}); retry later", retry_after_s=self.retry_after_s,
                ) from e
            self.note_ok()
            return out
        finally:
            if held:
                self.holding -= 1

    def _check_room(self, e: BaseException) -> None:
        if self.holding >= self.max_held:
            raise ServiceUnavailable(
                f"Redis is unreachable: {e}; {self.holding} requests already wait for it on this gateway "
                f"(redis_hold_max {self.max_held}); retry after {self.retry_after_s:g}s",
                retry_after_s=self.retry_after_s,
            ) from e

    def _time_left(self, start: float, deadline_ts: float | None) -> float:
        left = self.hold_s - (time.monotonic() - start)
        if deadline_ts:
            left = min(left, deadline_ts - time.time())
        return left if math.isfinite(left) else 0.0
