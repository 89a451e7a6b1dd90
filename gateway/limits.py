"""Per-API-key limits: concurrent requests and tokens per minute, accounted in this process.

Each gateway replica counts on its own, so with R replicas behind a load balancer a key can get
up to R times the configured limits; the bounds protect a replica, they are not a billing quota.
Without `api_keys` every client shares one "anonymous" key.

- Concurrency: a `Lease` is held while the gateway relays the request (released when the relay
  ends, or after `lease_ttl_s` if it never started, so a lost release cannot leak a slot).
- Tokens per minute: a request is charged prompt + max_tokens when admitted (a sliding window of
  60 s); when it ends the unused part of max_tokens is refunded. A request that alone needs more
  than the whole budget can never pass, so it gets a 400 instead of a 429.
Both rejections are `AdmissionRejected` (HTTP 429 / RESOURCE_EXHAUSTED) with Retry-After.
Memory is bounded: one entry per key, a window with at most one entry per admitted request.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem_core.errors import AdmissionRejected, InvalidRequest

WINDOW_S = 60.0


@dataclass
class _KeyState:
    leases: dict[int, float] = field(default_factory=dict)  # lease id -> expiry (monotonic)
    window: deque = field(default_factory=deque)  # [admitted_at, tokens] per request, oldest first


class Lease:
    """One admitted request. `release(used_tokens)` is idempotent."""

    def __init__(self, limiter: "KeyLimiter", key: str, lease_id: int, entry: list | None) -> None:
        self._limiter, self._key, self._id, self._entry = limiter, key, lease_id, entry
        self.released = False

    def release(self, used_tokens: int | None = None) -> None:
        if self.released:
            return
        self.released = True
        self._limiter._release(self._key, self._id, self._entry, used_tokens)


class KeyLimiter:
    def __init__(self, max_concurrent: int, tokens_per_minute: int, lease_ttl_s: float,
                 retry_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_concurrent = max_concurrent
        self.tokens_per_minute = tokens_per_minute
        self.lease_ttl_s = lease_ttl_s
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._keys: dict[str, _KeyState] = {}
        self._next_id = 0

    @property
    def enabled(self) -> bool:
        return bool(self.max_concurrent or self.tokens_per_minute)

    def acquire(self, key: str, tokens: int) -> Lease:
        """Admit a request of `tokens` (prompt + max_tokens) for `key`, or raise."""
        now = self._clock()
        st = self._keys.setdefault(key, _KeyState())
        self._expire(st, now)
        if self.max_concurrent and len(st.leases) >= self.max_concurrent:
            raise AdmissionRejected(
                f"this API key has {len(st.leases)} requests in progress, the limit is "
                f"{self.max_concurrent} concurrent requests per key; retry after {self.retry_after_s:g}s",
                retry_after_s=self.retry_after_s,
            )
        entry = self._charge(st, now, tokens) if self.tokens_per_minute else None
        self._next_id += 1
        st.leases[self._next_id] = now + self.lease_ttl_s
        return Lease(self, key, self._next_id, entry)

    def _charge(self, st: _KeyState, now: float, tokens: int) -> list:
        limit = self.tokens_per_minute
        if tokens > limit:
            raise InvalidRequest(
                f"this request needs {tokens} tokens (prompt + max_tokens), more than the limit of {limit} "
                f"tokens per minute per API key; lower max_tokens or shorten the prompt", param="max_tokens",
            )
        used = sum(e[1] for e in st.window)
        if used + tokens > limit:
            wait = self._wait_s(st, now, used + tokens - limit)
            raise AdmissionRejected(
                f"this API key used {used} of its {limit} tokens per minute and this request needs {tokens}; "
                f"retry after {wait:.0f}s", retry_after_s=wait,
            )
        entry = [now, tokens]
        st.window.append(entry)
        return entry

    @staticmethod
    def _wait_s(st: _KeyState, now: float, excess: int) -> float:
        """Seconds until the oldest entries leave the window and free `excess` tokens."""
        freed = 0
        for at, tokens in st.window:
            freed += tokens
            if freed >= excess:
                return max(1.0, at + WINDOW_S - now)
        return WINDOW_S

    def _expire(self, st: _KeyState, now: float) -> None:
        while st.window and st.window[0][0] + WINDOW_S <= now:
            st.window.popleft()
        for lid in [lid for lid, exp in st.leases.items() if exp <= now]:
            del st.leases[lid]

    def _release(self, key: str, lease_id: int, entry: list | None, used_tokens: int | None) -> None:
        st = self._keys.get(key)
        if st is None:
            return
        st.leases.pop(lease_id, None)
        if entry is not None and used_tokens is not None:
            entry[1] = min(entry[1], max(0, used_tokens))  # refund what was reserved but not generated

    def in_flight(self, key: str) -> int:
        st = self._keys.get(key)
        return len(st.leases) if st else 0
