"""The decode engine thread: it owns the device and every piece of JAX state.

Life of a request here (after the I/O side pulled its KV, see decode_svc/app.py):
1. The pulled payload arrives on the bounded `inserts` queue; between two steps the thread imports
   it onto the device and inserts it into a free slot. A prompt to prefill locally (colocated mode,
   or a short prompt the gateway routed direct) arrives on the same queue: the thread prefills it
   between two steps, publishes token 0 and inserts it (JetStream's interleaving: the I/O side only
   claims as many as there are free slots, so a full pod keeps decoding and prefills nothing).
2. Steps run back to back for all slots. The step is pipelined (the vLLM seed): step n is
   dispatched (JAX dispatch is asynchronous) *before* step n-1's tokens are copied to the host, so
   the device never waits on host bookkeeping. The cost: a finished slot is noticed one step late,
   and its extra token is dropped.
3. After copying step n-1's tokens, the thread decides per slot: emit the token, finish on a stop id,
   on max_tokens or at the end of the context; a finished slot is freed at once.
4. Each step's emitted tokens go to the bounded `outputs` queue as one batch; the I/O side writes
   them in one pipelined Redis round trip. If Redis falls behind, `outputs` fills and this thread
   blocks: back-pressure instead of unbounded memory.
Every step's batch is delivered (or the thread stops): no step's tokens are skipped silently.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from decode_svc.slots import Active, SlotTable
from tandem_core.errors import TandemError
from tandem_core.types import (
    FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, GenerationRequest, KVPayload,
)

log = logging.getLogger(__name__)


@dataclass
class Insert:
    payload: KVPayload
    req: GenerationRequest


@dataclass
class LocalPrefill:
    """A prompt this pod prefills itself (colocated mode, or routed direct by the gateway).
    `ack` is the (stream, group, entry id) to acknowledge once its first token is published."""

    req: GenerationRequest
    ack: tuple[str, str, bytes]


@dataclass
class Emitted:
    request_id: str
    index: int
    token: int  # -1 when a request ends without a token (cancelled)
    finish: str | None = None
    ack: tuple[str, str, bytes] | None = None  # acknowledged after this token is written
    error: str | None = None


@dataclass
class LoopStats:
    steps: int = 0
    tokens: int = 0
    local_prefills: int = 0
    host_wait_s: float = 0.0  # time blocked copying tokens to the host
    busy_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)


class EngineLoop:
    def __init__(self, engine, table: SlotTable, inserts: "queue.Queue[Insert | LocalPrefill]",
                 outputs: "queue.Queue[list[Emitted]]", on_slot_freed: Callable[[], None],
                 pipelined: bool = True, output_timeout_s: float = 30.0,
                 on_output: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.table = table
        self.inserts = inserts  # pulled KV and local prompts alike: both fill a reserved slot
        self.outputs = outputs
        self.on_slot_freed = on_slot_freed
        self.on_output = on_output  # wakes the publisher (no thread parked on the queue)
        self.pipelined = pipelined
        self.output_timeout_s = output_timeout_s
        self.stats = LoopStats()
        self._cancel: set[str] = set()
        self._silent: set[str] = set()
        self._cancel_lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self.thread.join(timeout_s)

    def cancel(self, request_ids: set[str], silent: bool = False) -> None:
        """Free these requests' slots within a step. `silent`: write nothing for them (they are
        owned elsewhere now); else a `cancelled` finish entry."""
        with self._cancel_lock:
            self._cancel |= request_ids
            if silent:
                self._silent |= request_ids

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - reported to the I/O side, which exits non-zero
            self.error = e
            log.exception("engine thread died")
            self.on_slot_freed()

    def _loop(self) -> None:
        state = self.engine.init_state()
        pending = None  # (device tokens, snapshot) of the step dispatched last
        while not self._stop.is_set():
            state = self._apply_cancels(state)
            idle = pending is None and self.table.used == 0
            state = self._apply_inserts(state, block_s=0.05 if idle else 0.0)
            current = None
            t0 = time.perf_counter()
            if self.table.used:
                snapshot = self.table.snapshot()
                # dispatch only (returns before the device is done), over the slots in use
                state, toks = self.engine.generate(state, self.table.rows())
                current = (toks, snapshot)
                self.stats.steps += 1
            if not self.pipelined and current is not None:
                state = self._process(current, state)
                current = None
            if pending is not None:
                state = self._process(pending, state)
            pending = current
            self.stats.busy_s += time.perf_counter() - t0

    def _apply_inserts(self, state, block_s: float):
        while self.table.free:
            try:
                item = self.inserts.get(timeout=block_s) if block_s else self.inserts.get_nowait()
            except queue.Empty:
                break
            block_s = 0.0
            if isinstance(item, LocalPrefill):
                prefix = self._local_prefill(item)
                if prefix is None:
                    continue
            else:
                prefix = self.engine.import_prefix(item.payload)
            slot = self.table.free_slot_index()
            state = self.engine.insert(prefix, state, slot, item.req.sampling)
            stop_ids = frozenset() if item.req.ignore_eos else frozenset(item.req.stop_token_ids)
            self.table.occupy(Active(item.req, slot, prefix.true_length, next_index=item.req.start_index + 1,
                                     stop_ids=stop_ids))
        return state

    def _local_prefill(self, item: LocalPrefill):
        """JetStream's interleaving on one pod: prefill between two decode steps. Returns the
        prefix to insert, or None when token 0 already ends the request (or it failed)."""
        req = item.req
        try:
            prefix = self.engine.prefill(req.prompt_ids, req.sampling)
        except TandemError as e:
            self.table.unreserve()
            self._emit([Emitted(req.request_id, req.start_index, -1, FINISH_ERROR, ack=item.ack, error=e.message)])
            return None
        self.stats.local_prefills += 1
        first = prefix.first_token
        finish = None
        if first in req.stop_token_ids and not req.ignore_eos:
            finish = FINISH_STOP
        elif req.max_tokens <= req.start_index + 1 or prefix.true_length >= self.engine.max_len:
            finish = FINISH_LENGTH
        self._emit([Emitted(req.request_id, req.start_index, first, finish, ack=item.ack)])
        if finish:
            self.table.unreserve()
            return None
        return prefix

    def _apply_cancels(self, state):
        with self._cancel_lock:
            if not self._cancel:
                return state
            ids, self._cancel = self._cancel, set()
            silent, self._silent = self._silent, set()
        out = []
        for act in self.table.snapshot():
            if act.req.request_id in ids:
                state = self._free(state, act)
                if act.req.request_id not in silent:
                    out.append(Emitted(act.req.request_id, act.next_index, -1, FINISH_CANCELLED))
        if out:
            self._emit(out)
        return state

    def _process(self, step, state):
        toks, snapshot = step
        t0 = time.perf_counter()
        host = np.asarray(toks)  # the one device -> host copy of the step
        self.stats.host_wait_s += time.perf_counter() - t0
        out: list[Emitted] = []
        max_len = self.engine.max_len
        for act in snapshot:
            if act.done:  # finished or cancelled after this step was dispatched
                continue
            tok = int(host[act.slot])
            idx = act.next_index
            act.next_index += 1
            finish = None
            if tok in act.stop_ids:
                finish = FINISH_STOP
            # A resumed request's prompt already holds tokens 0..start_index-1: the next input
            # goes to position prompt_len + (idx - start_index), which must stay inside max_len.
            elif idx + 1 >= act.req.max_tokens or act.prompt_len + idx - act.req.start_index >= max_len:
                finish = FINISH_LENGTH
            out.append(Emitted(act.req.request_id, idx, tok, finish))
            if finish:
                state = self._free(state, act)
        self.stats.tokens += len(out)
        if out:
            self._emit(out)
        return state

    def _free(self, state, act: Active):
        self.table.release(act.slot)
        state = self.engine.free(state, act.slot)
        self.on_slot_freed()
        return state

    def _emit(self, batch: list[Emitted]) -> None:
        # Blocks when the publisher is behind: that is the back-pressure. A publisher gone for
        # output_timeout_s is a dead pod, and the thread stops rather than hang forever.
        self.outputs.put(batch, timeout=self.output_timeout_s)
        if self.on_output is not None:
            self.on_output()
