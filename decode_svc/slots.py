"""Slot bookkeeping for the decode pod: which request occupies which slot, and how many slots the
I/O side may still claim work for (free slots minus pulls in flight and inserts queued).

`SlotTable` is shared by the engine thread and the event loop, so every method takes its lock.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tandem_core.types import GenerationRequest


@dataclass
class Active:
    """A request decoding in a slot. `next_index` is the index of the next token it will emit."""

    req: GenerationRequest
    slot: int
    prompt_len: int
    next_index: int = 1  # index 0 came from prefill
    done: bool = False
    stop_ids: frozenset[int] = field(default_factory=frozenset)


class SlotTable:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._lock = threading.Lock()
        self._active: dict[int, Active] = {}
        self._reserved = 0  # claimed ready entries not yet inserted (pulling or queued)
        self._held = 0  # choices of a local n > 1 prefill waiting for a slot (the engine's own)

    def reserve(self, n: int) -> int:
        """Reserve up to `n` slots for claims; returns how many were reserved."""
        with self._lock:
            take = max(0, min(n, self.slots - len(self._active) - self._reserved - self._held))
            self._reserved += take
            return take

    def unreserve(self, n: int = 1) -> None:
        with self._lock:
            self._reserved = max(0, self._reserved - n)

    def occupy(self, act: Active, held: bool = False) -> None:
        """Called by the engine thread when an insert lands; converts one reservation (or, with
        `held`, one held choice)."""
        with self._lock:
            self._active[act.slot] = act
            if held:
                self._held = max(0, self._held - 1)
            else:
                self._reserved = max(0, self._reserved - 1)

    def hold(self, n: int) -> None:
        """The engine keeps `n` more choices to insert: claims stop until they have slots."""
        with self._lock:
            self._held += n

    def unhold(self, n: int = 1) -> None:
        with self._lock:
            self._held = max(0, self._held - n)

    def free_slot_index(self) -> int | None:
        with self._lock:
            for s in range(self.slots):
                if s not in self._active:
                    return s
        return None

    def rows(self) -> int:
        """One past the highest occupied slot: a step need compute no slot at or above it (slots
        are filled lowest first, so this follows the number of requests in flight)."""
        with self._lock:
            return max(self._active, default=-1) + 1

    def release(self, slot: int) -> Active | None:
        with self._lock:
            act = self._active.pop(slot, None)
            if act:
                act.done = True
            return act

    def snapshot(self) -> list[Active]:
        with self._lock:
            return list(self._active.values())

    @property
    def used(self) -> int:
        with self._lock:
            return len(self._active)

    @property
    def free(self) -> int:
        with self._lock:
            return self.slots - len(self._active)

    @property
    def reserved(self) -> int:
        with self._lock:
            return self._reserved
