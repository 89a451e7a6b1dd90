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

Constrained slots (a request with a grammar, tandem_core/grammar.py): the slot keeps a Matcher,
rebuilt at insert from the output so far (prompt_ids[output_from:], then token `start_index`), so a
request resumed on another pod carries on where its stream left off. Step n+1's mask needs token n
on the host, so while any constrained slot is active the step runs unpipelined: the pending step
is drained, its tokens fed to the matchers, the masks computed, then the step is dispatched with
them and its tokens read at once. Unconstrained batches stay pipelined and use the maskless
compiled step. A complete grammar finishes its request with EOS ("stop") without another step;
a matcher error finishes that request with "error", never the loop. Matchers live with their slot.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from decode_svc.slots import Active, SlotTable
from tandem_core.errors import TandemError
from tandem_core.grammar import DEFAULT_CACHE_SIZE, DEFAULT_MASK_DEADLINE_S, GrammarError, Grammars, Matcher
from tandem_core.sampling_args import first_finish, insert_args, prefill_args
from tandem_core.types import (
    FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, GenerationRequest, KVPayload, choice_ids,
    TokenLogprobs, encode_prompt_logprobs,
)
from tandem_engine.logits import unpack_logprobs, unpack_tokens
from tandem_engine.prefix_cache import PrefixCache
from tandem_engine.prefix_cache import prefill as cached_prefill

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
    logprobs: str | None = None  # TokenLogprobs.encode() when the request asked for logprobs
    prompt_logprobs: str | None = None  # the index -1 entry of an echo with logprobs

    def item(self) -> tuple:
        """As `token_stream.OwnedPublisher.add_batch` takes it."""
        return (self.request_id, self.index, self.token, self.finish, self.error, self.logprobs,
                self.prompt_logprobs)


@dataclass
class HeldChoice:
    """A choice of a local n > 1 prefill waiting for a free slot (the KV stays on the device)."""

    prefix: object
    req: GenerationRequest
    first_token: int


@dataclass
class LoopStats:
    steps: int = 0
    tokens: int = 0
    local_prefills: int = 0
    host_wait_s: float = 0.0  # time blocked copying tokens to the host
    constrained_steps: int = 0  # steps run with grammar masks (unpipelined)
    mask_s: float = 0.0  # host time computing those masks
    busy_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)


def _consume(matcher: Matcher, token: int) -> str | None:
    """Feed a sampled token to its slot's matcher: None, or why the grammar rejected it."""
    try:
        matcher.consume(token)
    except GrammarError as e:
        return e.message
    return None


class EngineLoop:
    def __init__(self, engine, table: SlotTable, inserts: "queue.Queue[Insert | LocalPrefill]",
                 outputs: "queue.Queue[list[Emitted]]", on_slot_freed: Callable[[], None],
                 pipelined: bool = True, output_timeout_s: float = 30.0,
                 on_output: Callable[[], None] | None = None, grammar_cache_size: int = DEFAULT_CACHE_SIZE,
                 mask_deadline_s: float = DEFAULT_MASK_DEADLINE_S, prefix_cache: PrefixCache | None = None) -> None:
        self.engine = engine
        # local prefills reuse cached prefixes (None: a cache that is off, counting prefill tokens only)
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache(1, 0, enabled=False)
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
        self._held: deque[HeldChoice] = deque()  # counted in table.hold()
        self.grammars = Grammars(engine.info, cache_size=grammar_cache_size, deadline_s=mask_deadline_s)
        self._matchers: dict[int, Matcher] = {}  # slot -> its request's matcher, while it lives
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
            current, masks = None, None
            t0 = time.perf_counter()
            if pending is not None and self._matchers:  # the masks need the pending step's tokens
                state, pending = self._process(pending, state), None
            if self._matchers:
                state, masks = self._masks(state)
            if self.table.used:
                snapshot = self.table.snapshot()
                # dispatch only (returns before the device is done), over the slots in use; the
                # step with logprobs (a compiled variant of its own) only when a slot asks for them,
                # the masked one only when a slot has a grammar
                want = any(a.req.sampling.logprobs is not None for a in snapshot)
                kw = {"logprobs": True} if want else {}
                if masks is not None:
                    kw["masks"] = masks
                state, toks = self.engine.generate(state, self.table.rows(), **kw)
                current = (toks, snapshot, want)
                self.stats.steps += 1
            if (not self.pipelined or masks is not None) and current is not None:
                state = self._process(current, state)  # pending is None here: the order holds
                current = None
            if pending is not None:
                state = self._process(pending, state)
            pending = current
            self.stats.busy_s += time.perf_counter() - t0

    def _masks(self, state):
        """(state, masks [rows, words] for the next step, or None if no constrained slot is left).
        A complete grammar finishes its request here with EOS; a failed mask fails its request."""
        t0 = time.perf_counter()
        out: list[Emitted] = []
        rows = self.table.rows()
        masks = np.full((rows, self._words()), -1, np.int32)
        for act in self.table.snapshot():
            m = self._matchers.get(act.slot)
            if m is None:
                continue
            try:
                if not m.done():
                    m.mask_into(masks[act.slot])
                    continue
                k = act.req.sampling.logprobs  # EOS is certain under the grammar: logprob 0
                lp = TokenLogprobs(0.0, ((m.eos, 0.0),)[:k]).encode() if k is not None else None
                out.append(Emitted(act.req.request_id, act.next_index, m.eos, FINISH_STOP, logprobs=lp))
            except GrammarError as e:
                log.warning("grammar failed request_id=%s: %s", act.req.request_id, e.message)
                out.append(Emitted(act.req.request_id, act.next_index, -1, FINISH_ERROR, error=e.message))
            state = self._free(state, act)
        self.stats.mask_s += time.perf_counter() - t0
        if out:
            self.stats.tokens += sum(e.token >= 0 for e in out)
            self._emit(out)
        if not self._matchers or not self.table.used:
            return state, None
        self.stats.constrained_steps += 1
        return state, masks[: self.table.rows()]

    def _words(self) -> int:
        return (self.engine.info.vocab_size + 31) // 32

    def _apply_inserts(self, state, block_s: float):
        state = self._apply_held(state)  # choices already prefilled go first
        while self.table.free and not self._held:
            try:
                item = self.inserts.get(timeout=block_s) if block_s else self.inserts.get_nowait()
            except queue.Empty:
                break
            block_s = 0.0
            if isinstance(item, LocalPrefill):
                state = self._local_prefill(item, state)
                continue
            prefix = self.engine.import_prefix(item.payload)
            state = self._insert(state, prefix, item.req, item.payload.first_token)
        return state

    def _insert(self, state, prefix, req: GenerationRequest, first_token: int, held: bool = False):
        matcher = None
        if req.grammar is not None:  # the output so far, then token start_index: a resume carries on
            try:
                matcher = self.grammars.matcher(req.grammar, [*req.prompt_ids[req.output_from:], first_token])
            except TandemError as e:  # this request fails; its reservation (or hold) is given back
                self.table.unhold() if held else self.table.unreserve()
                self.on_slot_freed()
                self._emit([Emitted(req.request_id, req.start_index + 1, -1, FINISH_ERROR, error=e.message)])
                return state
        slot = self.table.free_slot_index()
        state = self.engine.insert(prefix, state, slot, req.sampling, **insert_args(req, first_token))
        if matcher is not None:
            self._matchers[slot] = matcher
        self.table.occupy(Active(req, slot, prefix.true_length, next_index=req.start_index + 1,
                                 stop_ids=frozenset(req.stop_token_ids)), held=held)
        return state

    def _local_prefill(self, item: LocalPrefill, state):
        """JetStream's interleaving on one pod: prefill between two decode steps, publish token
        `start_index` of every choice, and insert the choices that go on (the first into the
        reserved slot; with n > 1 the rest are held until slots free up)."""
        req = item.req
        try:
            prefix, _ = cached_prefill(self.engine, self.prefix_cache, req.prompt_ids, req.sampling,
                                       **prefill_args(req, self.grammars))
            prompt_lp = None
            if req.prompt_logprobs is not None and req.start_index == 0:
                prompt_lp = encode_prompt_logprobs(self.engine.prompt_logprobs(req.prompt_ids, req.prompt_logprobs))
        except TandemError as e:
            self.table.unreserve()
            ids = choice_ids(req.request_id, req.n)
            self._emit([Emitted(rid, req.start_index, -1, FINISH_ERROR, error=e.message,
                                ack=item.ack if rid == ids[-1] else None) for rid in ids])
            return state
        self.stats.local_prefills += 1
        choices = [req] if req.n <= 1 else [req.choice(i) for i in range(req.n)]
        out, going = [], []
        for c, first, lp in zip(choices, prefix.first_tokens, prefix.first_logprobs):
            finish = first_finish(c, first, prefix.true_length, self.engine.max_len)
            out.append(Emitted(c.request_id, c.start_index, first, finish,
                               logprobs=lp.encode() if lp is not None else None))
            if finish is None:
                going.append((c, first))
        if prompt_lp is not None:  # the index -1 entry, before token 0 (see token_stream.add_prompt_logprobs)
            out.insert(0, Emitted(choices[0].request_id, -1, -1, prompt_logprobs=prompt_lp))
        out[-1].ack = item.ack  # acknowledged once every choice's first token is written
        self.table.hold(len(going))  # the choices that go on are held, and take the first free slots
        self.table.unreserve()
        self._held.extend(HeldChoice(prefix, c, first) for c, first in going)
        self._emit(out)
        return self._apply_held(state)

    def _apply_held(self, state):
        while self._held and self.table.free:
            held = self._held.popleft()
            state = self._insert(state, held.prefix, held.req, held.first_token, held=True)
        return state

    def _apply_cancels(self, state):
        with self._cancel_lock:
            if not self._cancel:
                return state
            ids, self._cancel = self._cancel, set()
            silent, self._silent = self._silent, set()
        out = []
        for held in [h for h in self._held if h.req.request_id in ids]:
            self._held.remove(held)
            self.table.unhold()
            if held.req.request_id not in silent:
                out.append(Emitted(held.req.request_id, held.req.start_index + 1, -1, FINISH_CANCELLED))
        for act in self.table.snapshot():
            if act.req.request_id in ids:
                state = self._free(state, act)
                if act.req.request_id not in silent:
                    out.append(Emitted(act.req.request_id, act.next_index, -1, FINISH_CANCELLED))
        if out:
            self._emit(out)
        return state

    def _process(self, step, state):
        toks, snapshot, want = step
        t0 = time.perf_counter()
        host = np.asarray(toks)  # the one device -> host copy of the step
        self.stats.host_wait_s += time.perf_counter() - t0
        tokens = unpack_tokens(host) if want else host
        out: list[Emitted] = []
        max_len = self.engine.max_len
        for act in snapshot:
            if act.done:  # finished or cancelled after this step was dispatched
                continue
            tok = int(tokens[act.slot])
            idx = act.next_index
            act.next_index += 1
            finish, matcher = None, self._matchers.get(act.slot)
            error = None if matcher is None else _consume(matcher, tok)
            if error is not None:  # sampled under its mask, so never expected: fails this one only
                tok, finish = -1, FINISH_ERROR
            elif tok in act.stop_ids or (matcher is not None and matcher.done() and tok == matcher.eos):
                finish = FINISH_STOP
            # A resumed request's prompt already holds tokens 0..start_index-1: the next input
            # goes to position prompt_len + (idx - start_index), which must stay inside max_len.
            elif idx + 1 >= act.req.max_tokens or act.prompt_len + idx - act.req.start_index >= max_len:
                finish = FINISH_LENGTH
            k = act.req.sampling.logprobs
            lp = unpack_logprobs(host[act.slot], k).encode() if want and k is not None and tok >= 0 else None
            out.append(Emitted(act.req.request_id, idx, tok, finish, logprobs=lp, error=error))
            if finish:
                state = self._free(state, act)
        self.stats.tokens += len(out)
        if out:
            self._emit(out)
        return state

    def _free(self, state, act: Active):
        self._matchers.pop(act.slot, None)
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
