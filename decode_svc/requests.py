"""The decode pod's request table: every request the pod holds, in one of four named stages.

    (free slot) --reserve--> ticket --claim--> CLAIMED --> PULLING --> QUEUED --> RUNNING --> (gone)
                                                  \\___________________/
                                           a prompt to prefill here skips PULLING

- A *ticket* is a slot reserved before a claim reads Redis (the claim may return fewer entries:
  the rest are given back). Nothing is claimed without one: the JetStream rule, cluster-wide.
- CLAIMED: an entry of the ready, direct or admission stream is this pod's (a ticket became a record).
- PULLING: its KV is on the way over gRPC.
- QUEUED: on the bridge to the engine thread (pulled KV, a prompt to prefill here), or a choice of a
  local n > 1 prefill waiting for a slot (its KV already on the device).
- RUNNING: in a slot, decoding; the engine thread moves it there and removes it when it finishes.
A request's *entry* (the stream entry it came from) is tracked apart: a ready entry is acked once
the request is owned, a direct one once its first token is written, so an entry can outlive its
request's early stages, and a re-delivered entry still being worked on is not started twice.

Slots for new claims = slots - tickets - records (every record holds a seat from claim to finish).
The table is shared by the engine thread and the event loop: every method takes its lock.
"""
from __future__ import annotations

import enum
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

from tandem_core.types import GenerationRequest

Entry = tuple[str, bytes]  # (stream, entry id): ids are unique only within a stream


class Stage(enum.Enum):
    CLAIMED = "claimed"
    PULLING = "pulling"
    QUEUED = "queued"
    RUNNING = "running"


@dataclass
class Active:
    """A request decoding in a slot. `next_index` is the index of the next token it will emit."""

    req: GenerationRequest
    slot: int
    prompt_len: int
    next_index: int = 1  # index 0 came from prefill
    done: bool = False
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    # (slot, last index by length, looked at every step, request id): what a step's view of the
    # running set needs of it, fixed for its life in the slot; set by decode_svc/loop.py's StepView
    view_row: tuple | None = field(default=None, repr=False, compare=False)
    order: int = 0  # when it went into its slot (RequestTable.start): the newest is handed back first
    # paged KV with reuse: the tokens this pod fed its steps (the first token, then each emitted
    # but the last), so the row's blocks are kept under them when it is freed (None: not kept)
    fed: list[int] | None = None
    # a prompt this pod prefills a chunk a call beside the decode rows (decode_svc/loop.py `_seat`):
    # it holds its row but emits nothing until the call that ends its prompt gives token
    # `start_index` (then `next_index` is past it); `ack`: the entry acked with that first token
    seated: bool = False
    ack: tuple[str, str, bytes] | None = None
    # speculative decoding (decode_svc/speculate.py): the row's proposer state (None: not proposing)
    spec: Any = None


@dataclass
class Tracked:
    key: int
    request_id: str
    stage: Stage
    cancelled: bool = False  # the client cancelled it before it ran (see `cancel`)
    blocks: int = 0  # paged KV: its prompt's blocks, spoken for until it runs (decode_svc/blocks.py)


class RequestTable:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._tickets = 0
        self._records: dict[int, Tracked] = {}
        self._running: dict[int, Active] = {}  # slot -> the request in it
        self._slot_keys: dict[int, int] = {}  # slot -> its record's key
        self._entries: dict[Entry, str] = {}  # entries claimed and not yet acked -> request id
        self._started = itertools.count(1)  # Active.order

    # ------------------------------------------------------------ the I/O side
    def reserve(self, n: int) -> int:
        """Up to `n` tickets for a claim; returns how many (0 when every slot is spoken for)."""
        with self._lock:
            take = max(0, min(n, self.slots - self._tickets - len(self._records)))
            self._tickets += take
            return take

    @property
    def room(self) -> int:
        """Tickets a claim could get now (what `reserve` would grant at most)."""
        with self._lock:
            return max(0, self.slots - self._tickets - len(self._records))

    def unreserve(self, n: int = 1) -> None:
        """Give back tickets a claim did not use."""
        with self._lock:
            self._tickets = max(0, self._tickets - n)

    def claim(self, request_id: str, entry: Entry | None = None) -> int | None:
        """A ticket becomes a CLAIMED record; its key. None when `entry` is already being worked on
        here (delivered again while in flight): the ticket is given back."""
        with self._lock:
            self._tickets = max(0, self._tickets - 1)
            if entry is not None:
                if entry in self._entries:
                    return None
                self._entries[entry] = request_id
            key = next(self._keys)
            self._records[key] = Tracked(key, request_id, Stage.CLAIMED)
            return key

    def advance(self, key: int, stage: Stage) -> bool:
        """CLAIMED -> PULLING -> QUEUED; False if the client cancelled it meanwhile."""
        with self._lock:
            rec = self._records[key]
            rec.stage = stage
            return not rec.cancelled

    def promise(self, key: int, blocks: int) -> None:
        """Paged KV: the prompt blocks this record will take once it runs (spoken for till then)."""
        with self._lock:
            rec = self._records.get(key)
            if rec is not None:
                rec.blocks = blocks

    def blocks_ahead(self) -> tuple[int, int, int]:
        """(records, prompt blocks promised by those not running, tickets): what a claim counts
        against a paged pool (decode_svc/blocks.py `BlockBudget.claimable`)."""
        with self._lock:
            promised = sum(r.blocks for r in self._records.values() if r.stage is not Stage.RUNNING)
            return len(self._records), promised, self._tickets

    def cancelled(self, key: int) -> bool:
        """Whether the client cancelled this record's request (False once it is gone)."""
        with self._lock:
            rec = self._records.get(key)
            return rec is not None and rec.cancelled

    def entry_done(self, entry: Entry) -> None:
        """The entry was acked (or given up): a new delivery of it is new work."""
        with self._lock:
            self._entries.pop(entry, None)

    def busy_entries(self, stream: str) -> set[bytes]:
        with self._lock:
            return {eid for name, eid in self._entries if name == stream}

    def cancel(self, request_ids: set[str]) -> set[str]:
        """Mark these requests cancelled; returns those that are QUEUED or RUNNING (the engine
        thread frees them). A CLAIMED or PULLING one sees the mark when it advances."""
        with self._lock:
            to_engine = set()
            for rec in self._records.values():
                if rec.request_id in request_ids:
                    rec.cancelled = True
                    if rec.stage in (Stage.QUEUED, Stage.RUNNING):
                        to_engine.add(rec.request_id)
            return to_engine

    def request_ids(self, running: bool = True) -> list[str]:
        """Every request held here, in any stage; `running=False`: those not RUNNING (what the
        cancel watch polls: a running one's tokens are looked up for a cancel as they are written)."""
        with self._lock:
            if running:
                return list({rec.request_id for rec in self._records.values()})
            return list({rec.request_id for rec in self._records.values() if rec.stage is not Stage.RUNNING})

    def stages(self) -> dict[str, int]:
        with self._lock:
            out = {s.value: 0 for s in Stage}
            for rec in self._records.values():
                out[rec.stage.value] += 1
            return out

    # ------------------------------------------------------------ both sides
    def drop(self, key: int) -> None:
        """The record leaves before running (a failed pull, a resume elsewhere, a failed insert)."""
        with self._lock:
            self._records.pop(key, None)

    def queue_choice(self, request_id: str) -> int:
        """A choice of a local n > 1 prefill, waiting for a slot: a QUEUED record with no ticket
        (the engine thread adds it before it drops its parent's record)."""
        with self._lock:
            key = next(self._keys)
            self._records[key] = Tracked(key, request_id, Stage.QUEUED)
            return key

    # ------------------------------------------------------------ the engine thread
    def free_slot_index(self) -> int | None:
        with self._lock:
            return next((s for s in range(self.slots) if s not in self._running), None)

    def start(self, key: int, act: Active) -> None:
        """QUEUED -> RUNNING in slot `act.slot`."""
        with self._lock:
            rec = self._records[key]
            rec.stage = Stage.RUNNING
            act.order = next(self._started)
            self._running[act.slot] = act
            self._slot_keys[act.slot] = key

    def release(self, slot: int) -> Active | None:
        """RUNNING -> gone: the request finished, was cancelled or moved elsewhere."""
        with self._lock:
            act = self._running.pop(slot, None)
            key = self._slot_keys.pop(slot, None)
            if key is not None:
                self._records.pop(key, None)
            if act:
                act.done = True
            return act

    def rows(self) -> int:
        """One past the highest occupied slot: a step need compute no slot at or above it (slots
        are filled lowest first, so this follows the number of requests in flight)."""
        with self._lock:
            return max(self._running, default=-1) + 1

    def snapshot(self) -> list[Active]:
        with self._lock:
            return list(self._running.values())

    @property
    def used(self) -> int:
        """Slots running a request."""
        with self._lock:
            return len(self._running)

    @property
    def free(self) -> int:
        """Slots not running a request (some may be spoken for by claims on the way)."""
        with self._lock:
            return self.slots - len(self._running)

    @property
    def pending(self) -> int:
        """Tickets and records not yet running: work on its way to a slot."""
        with self._lock:
            return self._tickets + len(self._records) - len(self._running)
