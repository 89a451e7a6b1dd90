"""Prefill results held in host memory until a decode pod pulls them, under a byte budget.

Each entry has a lease: KV not pulled before it ends is freed (its request then fails with a
clear error on the token stream, written by the worker). The store itself does no I/O.
The n choices of one request (n > 1) hold one payload under n ids: its bytes count once, and
are freed with the last of them.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from tandem_core.types import KVPayload


@dataclass
class Held:
    request_id: str
    payload: KVPayload
    capability: str
    expires_at: float
    pulls: int = 0  # pulls started
    pulling: int = 0  # pulls in flight: the lease does not end under one (`KVStore.expired`)
    created: float = field(default_factory=time.monotonic)


class KVStore:
    """`held_bytes` never exceeds `budget_bytes`: callers ask `room_for(n)` before prefilling."""

    def __init__(self, budget_bytes: int, lease_s: float) -> None:
        self.budget_bytes = budget_bytes
        self.lease_s = lease_s
        self._items: dict[str, Held] = {}
        self._refs: dict[int, int] = {}  # id(payload) -> how many ids hold it
        self.held_bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def room_for(self, nbytes: int) -> int:
        """How many more payloads of `nbytes` fit in the budget."""
        return max(0, (self.budget_bytes - self.held_bytes) // max(1, nbytes))

    def put(self, request_id: str, payload: KVPayload) -> Held:
        return self.put_shared([request_id], payload)[0]

    def put_shared(self, request_ids: list[str], payload: KVPayload) -> list[Held]:
        """Hold one payload for each id (each with its own capability and lease)."""
        if self.held_bytes + payload.nbytes > self.budget_bytes:
            raise MemoryError(
                f"KV budget exceeded: holding {self.held_bytes} + {payload.nbytes} > {self.budget_bytes} bytes"
            )
        out = []
        for rid in request_ids:
            self.release(rid)  # a re-put under the same id replaces the old one
            held = Held(rid, payload, secrets.token_urlsafe(16), time.monotonic() + self.lease_s)
            self._items[rid] = held
            out.append(held)
        self._refs[id(payload)] = self._refs.get(id(payload), 0) + len(out)
        self.held_bytes += payload.nbytes
        return out

    def get(self, request_id: str) -> Held | None:
        return self._items.get(request_id)

    def release(self, request_id: str) -> bool:
        held = self._items.pop(request_id, None)
        if held is None:
            return False
        key = id(held.payload)
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.held_bytes -= held.payload.nbytes
        return True

    def expired(self, now: float | None = None) -> list[str]:
        """KV whose lease has ended and that no pull is streaming: a pull begun near the lease's
        end completes (the KV is then released), rather than decode after its request was failed.
        A pull in flight is bounded by its puller's deadline (gRPC cancels it, `pulling` drops)."""
        now = time.monotonic() if now is None else now
        return [rid for rid, h in self._items.items() if h.expires_at <= now and not h.pulling]
