"""The decode engine thread: it owns the device and every piece of JAX state.

Life of a request here (after the I/O side pulled its KV, see decode_svc/app.py):
1. The pulled payload arrives on the bounded `inserts` queue; between two steps the thread imports
   it onto the device and inserts it into a free slot. A prompt to prefill locally (colocated mode,
   or a short prompt the gateway routed direct) arrives on the same queue: the thread dispatches its
   prefill before the next step and, once that step is dispatched too, waits for the prefill,
   publishes token 0 and inserts it, so the host's part overlaps the step and the row joins the
   step after (JetStream's interleaving: the I/O side only claims as many as there are free slots,
   so a full pod keeps decoding and prefills nothing).
   While streams run, a long local prompt is instead seated in a free row and prefilled a chunk
   per call beside the rows' step (`_seat`, the engine's ragged call): the streams keep going.
2. Steps run back to back for all slots. The step is pipelined (the vLLM seed): step n is
   dispatched (JAX dispatch is asynchronous) *before* step n-1's tokens are copied to the host, so
   the device never waits on host bookkeeping. The cost: a finished slot is noticed one step late,
   and its extra token is dropped. Multi-step decode (`steps_per_dispatch` K, EngineConfig): one
   call runs K steps when no grammar and no waiting insert needs a single step, so the dispatch and
   this bookkeeping are paid once per K tokens a row; tokens reach the publisher in bursts of K, and
   a slot that finishes inside a call idles to its end (its later tokens are dropped, never emitted).
3. After copying step n-1's tokens, the thread decides per slot: emit the token, finish on a stop id,
   on max_tokens or at the end of the context; a finished slot is freed at once.
4. Each step's emitted tokens go to the bounded `outputs` queue as one batch; the I/O side writes
   them in one pipelined Redis round trip. If Redis falls behind, `outputs` fills and this thread
   blocks: back-pressure instead of unbounded memory.
Every step's batch is delivered (or the thread stops): no step's tokens are skipped silently.

The KV pool (decode_svc/blocks.py): a request goes into a row only when
the blocks for its prompt plus the reserve are free, else it waits in the held queue (oldest first);
before each call `_make_room` gets every row the blocks the call writes, handing the newest request
back (a `Preempted` on the outputs queue, behind its tokens) while some row cannot get them.

Constrained slots (a request with a grammar): while any is active the step runs unpipelined, since
step n+1's mask needs token n on the host (decode_svc/constrained.py). Unconstrained batches stay
pipelined and use the maskless compiled step.

Every request here is a record of the request table (decode_svc/requests.py): the thread moves it
from QUEUED to RUNNING at insert and removes it when it finishes; the queues and wake-ups are the
one bridge to the event loop (decode_svc/bridge.py).
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from decode_svc.blocks import BlockBudget
from decode_svc.bridge import Bridge
from decode_svc.constrained import SlotGrammars
from decode_svc.items import Emitted, HeldChoice, LocalPrefill, LoopStats, Preempted
from decode_svc.requests import Active, RequestTable
from decode_svc.settings import SpeculativeConfig
from decode_svc.speculate import Speculator
from tandem_core import faults
from tandem_core.errors import OutOfKVBlocks, TandemError
from tandem_core.grammar import DEFAULT_CACHE_SIZE, DEFAULT_MASK_DEADLINE_S
from decode_svc.local_prefill import Started, failed, start_here
from tandem_core.sampling_args import first_finish, insert_args
from tandem_core.types import FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, GenerationRequest, KVPayload
from tandem_engine.draft import DraftWarm
from tandem_engine.logits import unpack_logprobs, unpack_tokens

if TYPE_CHECKING:  # the type only: no JAX import
    from tandem_engine.api import ServingEngine, StepVariant
    from tandem_engine.draft import DraftProposer

log = logging.getLogger(__name__)

class EngineLoop:
    def __init__(self, engine: ServingEngine, table: RequestTable, bridge: Bridge, pipelined: bool = True,
                 output_timeout_s: float = 30.0, grammar_cache_size: int = DEFAULT_CACHE_SIZE,
                 mask_deadline_s: float = DEFAULT_MASK_DEADLINE_S, prefill_chunk_tokens: int = 0, steps_per_dispatch: int | None = None,
                 blocks: BlockBudget | None = None, late_warm: Sequence[StepVariant | DraftWarm] = (),
                 speculative: SpeculativeConfig | None = None, draft: DraftProposer | None = None) -> None:
        self.engine = engine
        # speculative decoding (decode_svc/speculate.py): n-gram or draft-model proposals checked in
        # one verify call while some row proposes (unpipelined then: the proposals need the last
        # call's tokens); `draft` (method "draft"): the draft model's proposer, run on this thread
        self.spec = Speculator(speculative, draft) if speculative is not None and speculative.on else None
        # the KV pool (decode_svc/blocks.py): a request goes into a row only when its blocks are
        # free, and rows that cannot grow hand the newest request back; None: the engine's own
        # budget, its reserve the engine's steps_per_dispatch
        self.blocks = BlockBudget.of(engine) if blocks is None else blocks
        # multi-step decode: this many steps per dispatched call when nothing needs a shorter one
        # (`_steps_for`); None: the engine's own setting (engine.steps_per_dispatch, EngineConfig)
        self.steps_per_dispatch = max(1, int(engine.steps_per_dispatch if steps_per_dispatch is None else steps_per_dispatch))
        # while streams run, a local prompt longer than this is prefilled a chunk (engine.prefix_chunk
        # tokens) a call beside the decode rows (chunked prefill in the step's own attention: `_seat`);
        # 0, or shorter prompts: whole, between two steps (but a prompt whose leading blocks the
        # pool keeps is always seated over them: only the rest is computed)
        self.prefill_chunk_tokens = int(prefill_chunk_tokens)
        self.table = table
        self.bridge = bridge  # pulled KV and local prompts in, each step's tokens out
        self.pipelined = pipelined
        self.output_timeout_s = output_timeout_s
        self.stats = LoopStats(late_compiles=len(late_warm))
        # step variants the pod's warm-up left out (the grammar-masked ones: the pod reports ready
        # that much sooner), compiled one per turn in which the loop has nothing to do (`_warm_one`);
        # a grammar request before then compiles its step on its own clock, as without a warm-up
        self.late_warm: deque[StepVariant | DraftWarm] = deque(late_warm)
        # speculation starts once the verify call's variants among them are compiled, and the draft
        # model's shapes (DraftWarm) with them (no request waits for one of those compiles: until
        # then every call is an ordinary one); its grammar-masked variants come last, and a grammar
        # request before then compiles its verify call on its own clock, as the masked step
        self._verify_left = sum(1 for v in late_warm if isinstance(v, DraftWarm) or (v.spec_k and not v.masked))
        self._cancel: set[str] = set()
        self._silent: set[str] = set()
        self._cancel_at: dict[str, int] = {}  # request id -> its next token index when the cancel came
        self._cancel_lock = threading.Lock()
        self._stop = threading.Event()
        self._held: deque[HeldChoice] = deque()  # QUEUED records of the table
        self._started: deque[Started] = deque()  # local prefills dispatched this turn, not waited for yet
        self._views = StepViews(engine.max_len)  # each running set's per-row arrays, built once per change
        self._views.constrained = lambda slot: self.grammars.get(slot) is not None
        self.grammars = SlotGrammars(engine.info, grammar_cache_size, mask_deadline_s)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self.thread.join(timeout_s)

    def cancel(self, request_ids: set[str], silent: bool = False) -> None:
        """Free these requests' slots within a step; a `cancelled` finish unless `silent` (owned elsewhere)."""
        at = {} if silent else {a.req.request_id: a.next_index for a in self.table.snapshot()
                                if a.req.request_id in request_ids}
        with self._cancel_lock:
            self._cancel |= request_ids
            if silent:
                self._silent |= request_ids
            for rid, index in at.items():  # the first cancel's index: a repeat (tokens in flight) is later
                self._cancel_at.setdefault(rid, index)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:
            self.error = e
            log.exception("engine thread died")
            self.bridge.wake_claims()

    def _loop(self) -> None:
        state = self.engine.init_state()
        pending: Call | None = None  # the call dispatched last, its tokens not read yet
        while not self._stop.is_set():
            state = self._apply_cancels(state)
            idle = pending is None and self.table.used == 0
            state = self._apply_inserts(state, block_s=0.05 if idle else 0.0)
            if idle and self.late_warm and not (self.table.used or self.table.pending or self.engine.prompts_pending
                                                or self._started):
                state = self._warm_one(state)
                continue
            current, masks = None, None
            t0, tokens0 = time.perf_counter(), self.stats.tokens
            if pending is not None and (self.grammars or self._proposing()):  # the masks (the proposals)
                state, pending = self._process(pending, state), None  # need the pending call's tokens
            if self.grammars:
                state, masks = self._masks(state)
            rows = self._decoding_rows() if self.spec is not None else 0  # the load the gate measures at
            if self.table.used:
                current, state = self._dispatch(state, masks)
            if self._started:  # local prompts dispatched before that call: their first tokens, their rows
                state = self._finish_prefills(state)
            if current is not None and (not self.pipelined or masks is not None or current.ragged
                                        or current.limits is not None):
                if pending is not None:  # (a ragged call: its first token is read now, so its row's
                    state, pending = self._process(pending, state), None  # next call sees it)
                state = self._process(current, state)
                current = None
            if pending is not None:
                state = self._process(pending, state)
            dispatched = current is not None or self.stats.tokens != tokens0
            pending = current
            spent = time.perf_counter() - t0
            self.stats.busy_s += spent
            if self.spec is not None and dispatched and not self._verify_left:  # the gate's measure
                self.spec.gate(rows).account(self.stats.tokens - tokens0, spent)

    def _warm_one(self, state):
        """Compile (run over the free rows) the next step variant the warm-up left: the loop is
        idle, no claim is on its way to a row (a request arriving meanwhile waits this one compile)."""
        t0 = time.perf_counter()
        variant = self.late_warm.popleft()
        if isinstance(variant, DraftWarm):  # the draft model's state is its own: the target's stays as it is
            assert self.spec is not None and self.spec.draft is not None
            self.spec.draft.warm(variant)
            self._verify_left -= 1
        else:
            state = self.engine.warm_step(state, variant)
            self._verify_left -= bool(variant.spec_k and not variant.masked)
        self.stats.late_compiled += 1
        self.stats.late_compile_s += time.perf_counter() - t0
        if not self.late_warm:
            log.info("warm-up: the %d step variants left to idle time compiled in %.1fs", self.stats.late_compiles,
                     self.stats.late_compile_s)
        return state

    def _dispatch(self, state, masks):
        """Dispatch one call over the slots in use (returns before the device is done): one step, or
        `steps_per_dispatch` of them (`_steps_for`); the variant with logprobs only when a slot asks for
        them, the masked one only when a slot has a grammar. Every row first gets the blocks the call
        writes (`_make_room`); None instead of a call when no row is left. While prompts are seated
        (`_seat`) and no grammar needs a mask, the call is ragged: the next chunk of the oldest
        seated prompt beside one step of the rows, over every slot (one compiled shape a variant)."""
        ragged = masks is None and self.engine.prompts_pending > 0
        steps = self._steps_for() if masks is None and self.steps_per_dispatch > 1 else 1
        proposing = self._proposing()
        if self.spec is not None:
            self.spec.tick([a.spec for a in self.table.snapshot()])
        if not ragged and proposing:  # (with grammars too: their masks for each query, `_verify`)
            state, call = self._verify(state, masks)
            if call is not None or not self.table.used:
                return call, state
        state = self._make_room(state, steps)
        if not self.table.used:
            return None, state
        if masks is not None:
            masks = masks[: self.table.rows()]
        snapshot = [a for a in self.table.snapshot() if not a.seated]
        view = self._views.of(snapshot)
        want = view.logprobs
        kw: dict[str, Any] = {"logprobs": True} if want else {}
        faults.hit("decode.step")
        if ragged:
            state, out = self.engine.generate_ragged(state, None, **kw)
            self.stats.steps += 1
            self.stats.calls += 1
            self.stats.ragged_calls += 1
            return Call(out.tokens, snapshot, want, 1, ragged=True, first_slot=out.slot, first=out.first), state
        if masks is not None:
            kw["masks"] = masks
        elif steps > 1:
            kw["steps"] = steps
        state, toks = self.engine.generate(state, self.table.rows(), **kw)
        self.stats.steps += steps
        self.stats.calls += 1
        self.stats.single_calls += steps == 1 and self.steps_per_dispatch > 1
        return Call(toks, snapshot, want, steps), state

    def _proposing(self) -> bool:
        return (self.spec is not None and not self._verify_left
                and self.spec.proposing([a.spec for a in self.table.snapshot() if not a.seated]))

    def _decoding_rows(self) -> int:
        """Rows decoding now (a seated prompt's row is not yet): the load whose gate decides."""
        return sum(1 for a in self.table.snapshot() if not a.seated)

    def _verify(self, state, masks=None):
        """A speculative call (decode_svc/speculate.py, the engine's `verify`): every running row's
        proposal, cut to what it may still emit, checked beside one step of every row. With
        grammar `masks` (this step's, [rows, words]) each constrained row's proposal is also cut
        where its grammar rejects it, and every query of the call gets the mask a plain step at
        its position would have (SlotGrammars.proposal_masks). (state, None) when no row
        proposes this time: the caller dispatches an ordinary call."""
        spec = self.spec
        assert spec is not None
        proposals = spec.propose_all([(act.slot, act.spec, last_index(act, self.engine.max_len) - act.next_index)
                                      for act in self.table.snapshot() if not act.seated])
        if not proposals:
            return state, None
        if not self.engine.can_reserve(spec.k + 1):  # a pool short of k + 1 positions a row: an
            self.stats.spec_short += 1  # ordinary call, whose room is a step's (no request is handed
            return state, None  # back for a proposal's sake)
        state = self._make_room(state, spec.k + 1)
        snapshot = [a for a in self.table.snapshot() if not a.seated]
        if not snapshot:
            return state, None
        kw: dict[str, Any] = {}
        if masks is not None:
            drawn = () if spec.draft_q is None else {a.slot for a in snapshot
                                                     if a.spec is not None and a.spec.sampling is not None}
            proposals, kw["masks"], spent = self.grammars.proposal_masks(snapshot, proposals,
                                                                         masks[: self.table.rows()], spec.k, drawn)
            self.stats.mask_s += spent
            if not proposals:
                return state, None
            self.stats.constrained_verifies += 1
        view = self._views.of(snapshot)
        if view.logprobs:
            kw["logprobs"] = True
        if spec.draft_q is not None:
            kw["draft_probs"] = spec.draft_q
        faults.hit("decode.step")
        state, out = self.engine.verify(state, proposals, spec.k, self.table.rows(), **kw)
        self.stats.steps += 1
        self.stats.calls += 1
        spec.stats.calls += 1
        tokens = np.swapaxes(out.tokens, 0, 1)  # [k + 1, bucket(, PACKED_WIDTH)]: a multi-step call's shape
        return state, Call(tokens, snapshot, view.logprobs, spec.k + 1, limits=out.counts, proposed=out.proposed)

    def _make_room(self, state, steps: int):
        """Blocks for the positions the next call writes, for every running row
        (`engine.reserve`). While some row cannot get them, the NEWEST request (the one that went
        into its row last) is freed here, silently, and handed back: resumed elsewhere from the
        tokens it has streamed (`Preempted`, after every token of it already queued; its tokens of
        the call in flight are dropped, as a finished row's are, and produced again by its resume,
        so none is lost or written twice). Newest first: the oldest rows, nearest their end, keep
        going, and the rows handed back have the least streamed to prefill again."""
        state, short = self.engine.reserve(state, steps)
        gone: list[Active] = []
        while short:
            # (a seated prompt's blocks were all taken when it was seated: it is never short, and
            # its entry is acked only with its first token, so it is not handed back)
            acts = [a for a in self.table.snapshot() if not a.seated]
            if not acts:
                raise RuntimeError(f"engine.reserve left slots {short} without KV blocks with no request running")
            newest = max(acts, key=lambda a: a.order)
            state = self._free(state, newest)
            gone.append(newest)
            state, short = self.engine.reserve(state, steps)
        if gone:
            alone = not self.table.used  # even one row did not fit: a resume counts as an attempt then
            self.stats.handed_back_for_blocks += len(gone)
            log.warning("KV blocks ran out (%d free of %d): handing back the newest %d of %d running requests: %s",
                        self.blocks.free(), self.blocks.total, len(gone),
                        len(gone) + self.table.used, [a.req.request_id for a in gone])
            self.bridge.put_output(Preempted([a.req for a in gone], "KV blocks ran out on its decode pod "
                                             "(the newest request is handed back)", counted=alone),
                                   self.output_timeout_s)
        return state

    def _held_ready(self) -> bool:
        """A held request can go into a row now (a free row, and its blocks free too)."""
        return bool(self._held) and self.table.free > 0 and self._fits(self._held[0].prefix, self._held[0].cached)

    def _fits(self, prefix, cached=None) -> bool:
        """Whether `prefix` goes into a row now (its blocks, less those its match of the block
        cache holds pinned already, are free with the reserve)."""
        have = 0 if cached is None else len(cached.blocks)
        return self.blocks.fits(prefix.true_length, self.table.used, have)

    def _steps_for(self) -> int:
        """`steps_per_dispatch`, or 1 while work waits for its turn on this thread (a pulled KV or a
        local prompt with a free slot, choices held, chunked prefills: one step between two looks at
        it, as without multi-step, so no prompt waits a whole call). A request that ends inside a
        call (stop id, length) has its later tokens dropped by `_process`; its slot idles for the
        rest of the call and is freed when the call's tokens are read (one call late, as one step is
        late without multi-step): a call of k steps holds a finished slot up to 2k - 1 steps."""
        if (self._held_ready() or self.engine.prompts_pending
                or (self.table.free and not self.bridge.inserts.empty())):
            return 1
        return self.steps_per_dispatch

    def _masks(self, state):
        """(state, masks [rows, words] for the next step, or None if no constrained slot is left)."""
        masks, out, done, spent = self.grammars.masks(self.table.snapshot(), self.table.rows())
        for act in done:
            state = self._free(state, act)
        self.stats.mask_s += spent
        if out:
            self.stats.tokens += sum(e.token >= 0 for e in out)
            self._emit(out)
        if not self.grammars or not self.table.used:
            return state, None
        self.stats.constrained_steps += 1
        return state, masks[: self.table.rows()]

    def _apply_inserts(self, state, block_s: float):
        state = self._apply_held(state)  # choices already prefilled go first
        while self.table.free and not self._held:
            item = self.bridge.get_insert(block_s)
            if item is None:
                break
            block_s = 0.0
            if isinstance(item, LocalPrefill):
                state = self._local_prefill(item, state)
                continue
            held = HeldChoice(item.payload, item.req, item.payload.first_token, item.key, item.cached)
            if not self._fits(item.payload, item.cached):  # its blocks went to growing rows since the claim
                self._held.append(held)
                break
            try:
                state = self._insert(state, item.payload, item.req, item.payload.first_token, item.key,
                                     item.cached)
            except OutOfKVBlocks:  # (the engine's count, should it differ from the fit check's)
                self._held.append(held)
                break
        return state

    def _insert(self, state, prefix, req: GenerationRequest, first_token: int, key: int, cached=None):
        try:  # the output so far, then token start_index: a resumed request carries on
            matcher = self.grammars.matcher_for(req, first_token)
        except TandemError as e:  # this request fails; its seat is given back
            self._release(cached)
            self.table.drop(key)
            self.bridge.wake_claims()
            self._emit([Emitted(req.request_id, req.start_index + 1, -1, FINISH_ERROR, error=e.message)])
            return state
        slot = self.table.free_slot_index()
        if slot is None:  # a claim holds a seat (RequestTable), so a queued request always finds one
            raise RuntimeError(f"no free slot to insert {req.request_id}: the request table admitted more "
                               f"requests than its {self.table.slots} slots (a bug in decode_svc/requests.py)")
        faults.hit("decode.insert")
        if isinstance(prefix, KVPayload):  # a pulled KV: straight from the host arrays into the slot
            state = self.engine.insert_payload(prefix, state, slot, req.sampling, **insert_args(req, first_token),
                                               cached=cached)
        else:  # a prefix on the device (prefilled here)
            state = self.engine.insert(prefix, state, slot, req.sampling, **insert_args(req, first_token))
        self.grammars.attach(slot, matcher)
        self.table.start(key, Active(req, slot, prefix.true_length, next_index=req.start_index + 1,
                                     stop_ids=frozenset(req.stop_token_ids),
                                     fed=[int(first_token)] if self.engine.kv_reuse else None,
                                     spec=None if self.spec is None else self.spec.start(
                                         req.prompt_ids, first_token, req.speculative, req.sampling)))
        return state

    def _local_prefill(self, item: LocalPrefill, state):
        """Prefill here. A prompt whose leading full blocks the pool keeps (a finished sequence's:
        a conversation's turn before) is seated over them (`_seat`): the ragged call computes only
        the rest, whether or not streams run. While streams run, a long prompt is seated too, to be
        prefilled a chunk a call beside them. Else it is prefilled whole between two steps
        (decode_svc/local_prefill.py, no cache: what the ragged call cannot serve, choices, a
        grammar, prompt logprobs, is computed again in full); the choices that go on take the
        prompt's seat and wait for slots (with n > 1 the rest wait until slots free up)."""
        try:
            faults.hit("decode.local_prefill")
            # chunked only when whole it would take more than the budget between two steps: a
            # prompt within it runs whole (one call at its bucket; in `prefix_chunk` pieces it costs
            # more calls: 8 ragged calls of 64 tokens took 1.65x the CPU of a whole 512-token prefill,
            # its insert and one step, bench/ragged.py)
            n = len(item.req.prompt_ids)
            self.stats.prompt_queries += n
            long = bool(self.prefill_chunk_tokens and (self.table.used or self._started)  # (streams soon)
                        and n > max(self.prefill_chunk_tokens, self.engine.prefix_chunk))
            seated = self._seat(item, state, hit_only=not long)
            if seated is not None:
                return seated
            self._started.append(start_here(self.engine, self.grammars.grammars, item))
            self.stats.prompt_computed += n
        except TandemError as e:
            self.table.drop(item.key)
            self._emit(failed(item, e.message))
        return state

    def _finish_prefills(self, state):
        """The local prompts `_local_prefill` dispatched this turn, before the decode call that
        followed them: wait for their first tokens (their calls ran first, so this waits for
        them, not for the step), publish them and put the choices that go on in rows, which join
        the next call. Meanwhile the device runs that call, so this host work (the tokens' copy,
        the publish, each insert) overlaps the step instead of idling the device before it."""
        while self._started:
            started = self._started.popleft()
            try:
                done = started.result()
            except TandemError as e:
                self.table.drop(started.item.key)
                self._emit(failed(started.item, e.message))
                continue
            state = self._prefilled(started.item, done, state)
        return state

    def _seat(self, item: LocalPrefill, state, hit_only: bool = False):
        """Seat a local prompt in a free row (`engine.begin_prompt`) to be prefilled a chunk a
        call by `_dispatch`'s ragged call (beside the running rows, if any); its leading blocks are
        the pool's own where a finished sequence left them (`match_prefix`), and only the rest is
        computed. Its record runs from now (it holds the row), `seated` until the call that ends
        the prompt gives its first token (`_first_token`). None (nothing changed) where the ragged
        call cannot serve it: choices (n > 1), a grammar, prompt logprobs, or its blocks not free
        with the reserve (a whole prefill then, which waits for them in the held queue); with
        `hit_only`, also where the pool keeps none of its blocks, and while a grammar row runs (the
        ragged call has no masked variant: a seated prompt would wait for the constrained rows to
        end)."""
        req = item.req
        if req.n > 1 or req.grammar is not None or (req.prompt_logprobs is not None and req.start_index == 0):
            return None
        if hit_only and (not self.engine.kv_reuse or self.grammars
                         or any(s.item.req.grammar is not None for s in self._started)):  # (a grammar row soon)
            return None
        slot = self.table.free_slot_index()
        cached = self.engine.match_prefix(req.prompt_ids) if self.engine.kv_reuse else None
        if hit_only and cached is None:
            return None
        have = 0 if cached is None else len(cached.blocks)
        if slot is None or not self.blocks.fits(len(req.prompt_ids), self.table.used, have):
            self._release(cached)
            return None
        try:
            state = self.engine.begin_prompt(state, slot, req.prompt_ids, req.sampling, output_from=req.output_from,
                                             start_index=req.start_index, stop_ids=list(req.stop_token_ids),
                                             cached=cached)
        except OutOfKVBlocks:
            self._release(cached)
            return None
        except BaseException:  # (PromptTooLong: the whole prefill's error then; the pins go)
            self._release(cached)
            raise
        self.stats.prompt_computed += len(req.prompt_ids) - (0 if cached is None else cached.length)
        self.stats.prompt_hits += 0 if cached is None else cached.length
        self.table.start(item.key, Active(req, slot, len(req.prompt_ids), next_index=req.start_index,
                                          stop_ids=frozenset(req.stop_token_ids), seated=True, ack=item.ack))
        return state

    def _first_token(self, call: Call, state):
        """A ragged call ended a seated prompt: its first token (token `start_index`) is emitted
        with its entry's ack, and its row decodes from the next call on (or is freed when that
        token already ends it)."""
        act = next((a for a in self.table.snapshot() if a.slot == call.first_slot and a.seated), None)
        if act is None:  # (freed since the call was dispatched: nothing to emit)
            return state
        req = act.req
        host = np.asarray(call.first)
        tok = int(unpack_tokens(host[None])[0])
        k = req.sampling.logprobs
        finish = first_finish(req, tok, act.prompt_len, self.engine.max_len)
        out = Emitted(req.request_id, req.start_index, tok, finish, ack=act.ack,
                      logprobs=unpack_logprobs(host, k).encode() if k is not None else None)
        act.seated, act.ack, act.next_index = False, None, req.start_index + 1
        act.fed = [tok] if self.engine.kv_reuse else None
        act.spec = None if self.spec is None else self.spec.start(req.prompt_ids, tok, req.speculative, req.sampling)
        self.stats.local_prefills += 1
        self.stats.tokens += 1
        if finish is not None:
            state = self._free(state, act)
        self._emit([out])
        return state

    def _prefilled(self, item: LocalPrefill, done, state):
        self.stats.local_prefills += 1
        self._held.extend(HeldChoice(done.prefix, c, first, self.table.queue_choice(c.request_id))
                          for c, first in done.going)
        need = self.blocks.blocks_for(done.prefix.true_length)  # each choice's own copy of the prompt's blocks
        for held in list(self._held)[-len(done.going):] if done.going else []:
            self.table.promise(held.key, need)
        self.table.drop(item.key)  # after its choices took their seats: claims never see a gap
        self._emit(done.emitted)
        return self._apply_held(state)

    def _apply_held(self, state):
        while self._held_ready():  # oldest first: one that does not fit yet holds the rest back
            held = self._held.popleft()
            try:
                state = self._insert(state, held.prefix, held.req, held.first_token, held.key, held.cached)
            except OutOfKVBlocks:  # the pool is fuller than the fit check saw: wait for a free
                self._held.appendleft(held)
                break
        return state

    def _apply_cancels(self, state):
        with self._cancel_lock:
            if not self._cancel:
                return state
            ids, self._cancel = self._cancel, set()
            silent, self._silent = self._silent, set()
            at, self._cancel_at = self._cancel_at, {}
        out = []
        for held in [h for h in self._held if h.req.request_id in ids]:
            self._held.remove(held)
            self._release(held.cached)
            self.table.drop(held.key)
            if held.req.request_id not in silent:
                out.append(Emitted(held.req.request_id, held.req.start_index + 1, -1, FINISH_CANCELLED))
                self.stats.cancelled += 1
        for act in self.table.snapshot():
            if act.req.request_id in ids:
                state = self._free(state, act)
                if act.req.request_id not in silent:  # (a seated prompt's entry is acked with it)
                    out.append(Emitted(act.req.request_id, act.next_index, -1, FINISH_CANCELLED, ack=act.ack))
                    self.stats.cancelled += 1
                    # tokens it still produced after the cancel reached this pod: the step in flight
                    lag = act.next_index - at.get(act.req.request_id, act.next_index)
                    self.stats.cancel_lag_tokens = max(self.stats.cancel_lag_tokens, lag)
        if out:
            self._emit(out)
        return state

    def _process(self, call: Call, state):
        """Emit one call's tokens (`_rows`), then, where a ragged call ended a seated prompt, its
        first token (`_first_token`)."""
        state = self._rows(call, state)
        if call.first_slot is not None:
            state = self._first_token(call, state)
        return state

    def _rows(self, step: Call, state):
        """Emit one call's tokens (one step's, or `steps` of them: [steps, bucket]). The decisions run
        over the call's token array at once (numpy: which rows end by length, which sampled a stop
        id); Python per row only builds its entries, and looks closer at the few (row, step) pairs
        that finish, sample a stop id, carry a grammar or want logprobs. A row that finishes at step j
        of a multi-step call keeps its tokens up to j; those after it are dropped (never emitted)."""
        toks, snapshot, want, steps = step.tokens, step.snapshot, step.want, step.steps
        t0 = time.perf_counter()
        host = np.asarray(toks)  # the one device -> host copy of the call
        self.stats.host_wait_s += time.perf_counter() - t0
        if steps == 1:
            host = host[None]
        tokens = host[..., 0] if want else host  # [steps, bucket]
        view = self._views.of(snapshot)
        live = view.live()  # those not finished or cancelled since this call was dispatched
        if not live.acts:
            return state
        n = len(live.acts)
        got = tokens[:, live.slots]  # [steps, rows]
        idx = np.fromiter([a.next_index for a in live.acts], np.int64, n)
        at = idx + np.arange(steps)[:, None]  # each token's index
        look = at >= live.last  # ends by length (max_tokens, or the end of the context)
        if live.stop_ids.size:  # sampled some row's stop id: that row's own? (a table lookup, not np.isin)
            look |= live.stop_mask[np.minimum(got, live.stop_mask.size - 1)]
        if live.special.any():
            look |= live.special  # a grammar to feed or logprobs to encode
        count = [steps] * n  # tokens each row emits from this call
        if step.limits is not None:  # a verify call: row r emitted limits[slot] of its k + 1
            count = step.limits[live.slots].tolist()
            look &= np.arange(steps)[:, None] < np.array(count)[None, :]
        ends: dict[tuple[int, int], tuple[str, str | None]] = {}  # (step, row) -> (finish, error)
        lp: dict[tuple[int, int], str] = {}
        if look.any():
            for row in np.flatnonzero(look.any(axis=0)).tolist():
                act = live.acts[row]
                k = act.req.sampling.logprobs
                for j in np.flatnonzero(look[:, row]).tolist():
                    tok = int(got[j, row])
                    fed = self.grammars.consume(act.slot, tok)
                    error = fed.error
                    finish = finish_of(act, int(at[j, row]), tok, error, fed.done, self.engine.max_len)
                    if want and k is not None and error is None:
                        lp[j, row] = (self.grammars.forced_logprobs(act.slot, k) if fed.forced
                                      else unpack_logprobs(host[j, act.slot], k).encode())
                    if finish:
                        ends[j, row] = (finish, error)
                        count[row] = j + 1
                        break
        rids, idxs = live.rids, idx.tolist()
        if steps == 1 or min(count) == steps:
            out = [Emitted(rid, i + j, t) for j, line in enumerate(got.tolist())
                   for rid, i, t in zip(rids, idxs, line)]
        else:  # step-major, so each request's entries stay in index order
            out = [Emitted(rid, i + j, t) for j, line in enumerate(got.tolist())
                   for rid, i, t, c in zip(rids, idxs, line, count) if j < c]
        if lp or ends:  # entry (j, row)'s place in `out`: the emitted pairs before it, step-major
            place = np.cumsum(np.arange(steps)[:, None] < np.array(count)) - 1
            for (j, row), text in lp.items():
                if j < count[row]:
                    out[place[j * n + row]].logprobs = text
            for (j, row), (finish, error) in ends.items():
                e = out[place[j * n + row]]
                if error is not None:
                    e.token, e.error = -1, error
                e.finish = finish
        for act, c in zip(live.acts, count):
            act.next_index += c
        if self.spec is not None:  # each row's context grows by what it emitted; a checked proposal counts
            for act, c, line in zip(live.acts, count, got.T.tolist()):
                proposed = 0 if step.proposed is None else int(step.proposed[act.slot])
                kept = 0 if step.limits is None else int(step.limits[act.slot]) - 1
                self.spec.observe(act.spec, proposed, line[:c], min(kept, proposed))
        if self.engine.kv_reuse:  # what each row fed its steps: its blocks are kept under them
            for act, c, line in zip(live.acts, count, got.T.tolist()):
                if act.fed is not None:
                    act.fed += line[:c]
        for (_j, row) in ends:
            state = self._free(state, live.acts[row])
        self.stats.tokens += len(out)
        self._emit(out)
        return state

    def _free(self, state, act: Active):
        self.grammars.forget(act.slot)
        self.table.release(act.slot)
        # the KV its positions hold: the prompt, then each token fed (the last emitted never was)
        fed = None if act.fed is None else act.req.prompt_ids + act.fed[:-1]
        state = self.engine.free(state, act.slot, tokens=fed)
        self.bridge.wake_claims()
        return state

    def _release(self, cached) -> None:
        """Unpin a pulled part's match whose request will not be inserted here."""
        if cached is not None:
            self.engine.release_prefix(cached)

    def _emit(self, batch: list[Emitted]) -> None:
        # Blocks when the publisher is behind: that is the back-pressure. A publisher gone for
        # output_timeout_s is a dead pod, and the thread stops rather than hang forever.
        self.bridge.put_output(batch, self.output_timeout_s)


@dataclass(frozen=True)
class Call:
    """A dispatched call, until its tokens are read: the device tokens ([bucket] or [steps,
    bucket], packed with logprobs when `want`), the running set it was dispatched for, its steps;
    a ragged call (`EngineLoop._dispatch`) with, when it ended a seated prompt, that row and its
    first token (packed, on the device)."""

    tokens: Any
    snapshot: list[Active]
    want: bool
    steps: int
    ragged: bool = False
    first_slot: int | None = None
    first: Any = None
    limits: Any = None  # a verify call: int [bucket], the tokens each row emitted (of `steps` = k + 1)
    proposed: Any = None  # and how many of its proposals each row had checked


@dataclass(frozen=True)
class StepView:
    """The per-row arrays of one set of running requests (a step's snapshot), in snapshot order:
    what `_process` decides with over a whole step, built once per change of the set."""

    acts: tuple[Active, ...]
    slots: np.ndarray  # each row's slot (indexes the step's token array)
    last: np.ndarray  # the index at which each row ends by length
    stop_ids: np.ndarray  # every row's stop ids together (a hit is checked against its own row's)
    stop_mask: np.ndarray  # token -> one of `stop_ids`, one past the highest (False: any token beyond)
    special: np.ndarray  # rows with a grammar or that want logprobs: looked at every step
    rids: tuple[str, ...]
    logprobs: bool = False  # some row wants logprobs: the step returns them (the same compiled step: a traced flag)

    @classmethod
    def of(cls, acts, max_len: int, constrained) -> StepView:
        acts = tuple(acts)
        if not acts:
            return cls((), np.zeros(0, np.intp), np.zeros(0, np.int64), np.zeros(0, np.int64), _stop_mask(frozenset()),
                       np.zeros(0, bool), ())
        rows = [a.view_row or _view_row(a, max_len, constrained) for a in acts]  # per row once in its life
        slots, last, special, rids = zip(*rows)
        stops = frozenset().union(*(a.stop_ids for a in acts))
        return cls(acts, np.array(slots, np.intp), np.array(last, np.int64), np.fromiter(stops, np.int64, len(stops)),
                   _stop_mask(stops), np.array(special, bool), rids, any(a.req.sampling.logprobs is not None for a in acts))

    def live(self) -> StepView:
        """Without the rows finished or cancelled since the snapshot (itself when none is)."""
        if not any(a.done for a in self.acts):
            return self
        keep = np.fromiter((not a.done for a in self.acts), bool, len(self.acts))
        acts = tuple(a for a in self.acts if not a.done)
        return StepView(acts, self.slots[keep], self.last[keep], self.stop_ids, self.stop_mask, self.special[keep],
                        tuple(a.req.request_id for a in acts))


class StepViews:
    """The `StepView` of the latest snapshot, rebuilt only when the running set changed (the
    table's snapshot is a new list each step, of the same `Active` records while nothing changed)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.constrained = lambda slot: False
        self._key: tuple = ()
        self._view: StepView | None = None

    def of(self, snapshot: list[Active]) -> StepView:
        key = tuple(map(id, snapshot))
        if self._view is None or key != self._key:  # (the view holds its records: no id is reused meanwhile)
            self._key, self._view = key, StepView.of(snapshot, self.max_len, self.constrained)
        return self._view


@functools.lru_cache(maxsize=16)
def _stop_mask(stops: frozenset[int]) -> np.ndarray:
    """A lookup table of these stop ids (the same few sets come back, so each is built once): True
    at each, False at the last entry, where `_process` clips every token past the table."""
    ids = [t for t in stops if 0 <= t < 1 << 22]  # none beyond: no vocabulary is that large, no token matches
    mask = np.zeros(max(ids, default=-1) + 2, bool)
    mask[ids] = True
    return mask


def _view_row(act: Active, max_len: int, constrained) -> tuple:
    """`Active.view_row`: computed at the first step that sees the request, kept while it runs (its
    slot, length limit, grammar and logprobs do not change in the slot)."""
    row = act.view_row = (act.slot, last_index(act, max_len),
                          act.req.sampling.logprobs is not None or constrained(act.slot), act.req.request_id)
    return row


def last_index(act: Active, max_len: int) -> int:
    """The index of the request's last token by length (`finish_of`'s length rule, solved for idx)."""
    return min(act.req.max_tokens - 1, max_len - act.prompt_len + act.req.start_index)


def finish_of(act: Active, idx: int, tok: int, error: str | None, grammar_done: bool, max_len: int) -> str | None:
    """Why the request ends with this token (None: it goes on)."""
    if error is not None:  # sampled under its mask, so never expected: fails this one only
        return FINISH_ERROR
    if tok in act.stop_ids or grammar_done:
        return FINISH_STOP
    # A resumed request's prompt already holds tokens 0..start_index-1: the next input goes
    # to position prompt_len + (idx - start_index), which must stay inside max_len.
    if idx + 1 >= act.req.max_tokens or act.prompt_len + idx - act.req.start_index >= max_len:
        return FINISH_LENGTH
    return None
