"""The token relay: one request's token stream in Redis -> text deltas for a client.

Written once and used by both transports (SSE and gRPC). The life of a relay:
1. Subscribe to `tandem:tok:{rid}` on the gateway's one token reader (gateway/tokens.py: one
   blocking XREAD for every stream relayed) and take its entries as they come, under two deadlines:
   the whole request (`request_timeout_s`) and, until the first token arrives,
   `first_token_timeout_s`. Past either: cancel the request and raise DeadlineExceeded.
2. Every entry carries its token index. An index already relayed is a duplicate (a retried
   worker re-publishes from the start) and is dropped; an index ahead of the next one waits in a
   bounded buffer until the gap is filled, so the client sees each token exactly once, in order.
3. Tokens are detokenized incrementally; EOS ids are not emitted as text. Stop strings are
   matched across token boundaries: text that could be the start of a stop string is held back
   until it is known not to be one. A match truncates the text, finishes with "stop" and sets the
   cancel key so workers free the slot.
4. An entry with `f` finishes the request (`e` + `f=error` -> WorkerFailed). If the relay ends
   any other way (client gone, deadline, error) the cancel key is set, from a task of its own so
   that a cancelled caller cannot stop it.

It must not know about HTTP or gRPC; it yields `Delta`s and raises `TandemError`s.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.metrics import GatewayMetrics
from gateway.tokens import Subscription, TokenMux
from gateway.validation import Prepared
from tandem_core.bus import cancel, token_stream
from tandem_core.errors import DeadlineExceeded, WorkerFailed
from tandem_core.bus import KeySpace
from tandem_core.tokenizer import Detokenizer, Tokenizer
from tandem_core.types import (
    FINISH_CANCELLED, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, TokenLogprobs, decode_prompt_logprobs,
)

log = logging.getLogger(__name__)


@dataclass
class Delta:
    """One relayed token (or, with token_id -1, a finish without a token)."""

    index: int
    token_id: int
    text: str
    finish_reason: str | None = None
    completion_tokens: int = 0  # tokens relayed so far, this one included (all choices, when n > 1)
    choice: int = 0
    logprobs: TokenLogprobs | None = None  # when the request asked for them
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on index 0 of an echo with logprobs


class TextAssembler:
    """Detokenization plus stop strings for one request. Pure: feed ids, get text."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], eos_ids: tuple[int, ...] | list[int],
                 min_tokens: int = 0, skip_special_tokens: bool = True) -> None:
        self._detok = Detokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._min_tokens = min_tokens  # stop strings match only once this many tokens are out
        self._fed = 0
        self._max_stop = max((len(s) for s in stop), default=0)
        self._eos = set(eos_ids)
        self._held = ""  # text that may be the start of a stop string
        self.stopped = False

    def feed(self, token_id: int) -> str:
        """Text to emit for this token; sets `stopped` when a stop string matched."""
        self._fed += 1
        if self.stopped or token_id in self._eos or token_id < 0:
            return ""
        return self._push(self._detok.feed(token_id))

    def finish(self) -> str:
        """Everything still held back, once no more tokens will come."""
        if self.stopped:
            return ""
        text = self._push(self._detok.flush())
        if self.stopped:
            return text
        text, self._held = text + self._held, ""
        return text

    def _push(self, new: str) -> str:
        if not self._stop or self._fed < self._min_tokens:
            return self._held_out(new)
        pending = self._held + new
        cut = min((i for i in (pending.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return pending[:cut]
        keep = self._holdback(pending)
        self._held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def _held_out(self, new: str) -> str:
        text, self._held = self._held + new, ""
        return text

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._max_stop - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0


class _Deadlines:
    def __init__(self, arrival: float, total_s: float, first_s: float) -> None:
        self.end = arrival + total_s
        self.first = arrival + first_s

    def remaining(self, got_first: bool) -> tuple[float, str]:
        now = time.monotonic()
        if not got_first and self.first < self.end:
            return self.first - now, "first token"
        return self.end - now, "request"


async def relay(
    r: aioredis.Redis,
    mux: TokenMux,
    prep: Prepared,
    tokenizer: Tokenizer,
    *,
    entry_id: bytes | None = None,
    block_ms: int,
    request_timeout_s: float,
    first_token_timeout_s: float,
    cancel_ttl_s: int,
    metrics: GatewayMetrics,
    background: set[asyncio.Task],
    on_detach: Callable[[], None] | None = None,
) -> AsyncIterator[Delta]:
    """Yield the request's tokens as Deltas; the last one has `finish_reason` set.

    `entry_id`: the request's admission entry id (None on a resume), the start of the queue-time
    metric. `on_detach` (resumable requests): called instead of cancelling when the caller goes away
    (the relay is cancelled or closed) before the end."""
    req = prep.request
    text = TextAssembler(tokenizer, prep.stop, req.stop_token_ids, req.sampling.min_tokens,
                         prep.skip_special_tokens)
    dl = _Deadlines(prep.arrival_ts, request_timeout_s, first_token_timeout_s)
    state = _RelayState(req.max_tokens, entry_id)
    finished = detached = False
    metrics.running.inc()
    try:
        async for delta in _pump(mux, req.request_id, text, dl, state, block_ms, metrics, prep):
            finished = delta.finish_reason is not None
            yield delta
    except (asyncio.CancelledError, GeneratorExit):
        detached = True
        raise
    finally:
        metrics.running.dec()
        if detached and not finished and on_detach is not None:
            on_detach()
        elif not finished or text.stopped or state.gateway_finished:
            cancel_soon(r, mux.ks, req.request_id, cancel_ttl_s, background)
        if state.last_ts is not None and not prep.replay:
            metrics.e2e.observe(state.last_ts - prep.arrival_ts)


@dataclass
class _RelayState:
    max_tokens: int
    entry_id: bytes | None = None  # the admission entry id: queue time = first token's entry - this
    next_index: int = 0
    last_ts: float | None = None
    gateway_finished: bool = False  # the gateway, not a worker, decided the end (max_tokens)
    prompt_logprobs: list | None = None  # from the index -1 entry, handed out with index 0


async def _pump(
    mux: TokenMux, rid: str, text: TextAssembler, dl: _Deadlines, st: _RelayState,
    block_ms: int, metrics: GatewayMetrics, prep: Prepared,
) -> AsyncIterator[Delta]:
    sub = mux.subscribe(rid)  # from the stream's first entry (a resume replays it all)
    try:
        async for delta in _relay_events(sub, text, dl, st, block_ms, metrics, prep):
            yield delta
    finally:
        mux.unsubscribe(sub)


async def _relay_events(
    sub: Subscription, text: TextAssembler, dl: _Deadlines, st: _RelayState,
    block_ms: int, metrics: GatewayMetrics, prep: Prepared,
) -> AsyncIterator[Delta]:
    rid = sub.request_id
    ahead: dict[int, token_stream.TokenEvent] = {}  # out-of-order entries, bounded by max_tokens
    while True:
        left, which = dl.remaining(st.next_index > 0)
        if left <= 0:
            raise DeadlineExceeded(f"no {which} within the deadline; request {rid} cancelled: retry later, or with a "
                                   "longer timeout")
        # A Redis restart shows here only as a longer wait: the reader retries, the stream persists.
        events = await sub.get(min(block_ms / 1000, left))
        for ev in events:
            if ev.prompt_logprobs is not None:  # the prompt's logprobs (echo)
                st.prompt_logprobs = decode_prompt_logprobs(ev.prompt_logprobs)
            if ev.index < 0:  # the index -1 entry carries nothing else
                continue
            if ev.token_id < 0 and ev.finish_reason:  # a finish without a token: terminal
                yield _finish_without_token(ev, text, st)
                return
            if ev.index < st.next_index or ev.index in ahead:
                metrics.duplicates.inc()
                continue
            if ev.index >= st.max_tokens:
                log.warning("token index %d beyond max_tokens request_id=%s", ev.index, rid)
                continue
            ahead[ev.index] = ev
            while st.next_index in ahead:
                delta = _accept(ahead.pop(st.next_index), text, st, metrics, prep)
                yield delta
                if delta.finish_reason:
                    return


def _accept(ev, text: TextAssembler, st: _RelayState, metrics: GatewayMetrics, prep: Prepared) -> Delta:
    now = time.monotonic()
    if prep.replay:
        pass  # a resume replays old tokens: their timing says nothing about the cluster
    elif st.next_index == 0:
        metrics.ttft.observe(now - prep.arrival_ts)
        _observe_queue(metrics, st.entry_id, ev.entry_id)
    elif st.last_ts is not None:
        metrics.itl.observe(now - st.last_ts)
    st.last_ts = now
    st.next_index += 1
    chunk = text.feed(ev.token_id)
    finish = ev.finish_reason
    if text.stopped:
        finish = FINISH_STOP
    elif finish is None and st.next_index >= st.max_tokens:
        finish, st.gateway_finished = FINISH_LENGTH, True  # a worker overran max_tokens
    if finish == FINISH_ERROR:
        raise WorkerFailed(ev.error or "worker failed")
    if finish and not text.stopped:
        chunk += text.finish()
    prompt_lp = st.prompt_logprobs if ev.index == 0 else None
    return Delta(ev.index, ev.token_id, chunk, finish, st.next_index, logprobs=ev.logprobs, prompt_logprobs=prompt_lp)


def _finish_without_token(ev, text: TextAssembler, st: _RelayState) -> Delta:
    if ev.finish_reason == FINISH_ERROR:
        raise WorkerFailed(ev.error or "worker failed")
    reason = ev.finish_reason if ev.finish_reason in (FINISH_STOP, FINISH_LENGTH) else FINISH_CANCELLED
    return Delta(max(ev.index, st.next_index), -1, text.finish(), reason, st.next_index)


def _observe_queue(metrics: GatewayMetrics, admitted_id: bytes | None, entry_id: bytes) -> None:
    """Admission XADD -> first token XADD, both from stream entry ids (Redis clock)."""
    if admitted_id is None:
        return
    try:
        t0 = int(admitted_id.split(b"-")[0])
        t1 = int(entry_id.split(b"-")[0])
    except (ValueError, AttributeError):
        return
    metrics.queue.observe(max(0.0, (t1 - t0) / 1000.0))


def cancel_soon(r: aioredis.Redis, ks: KeySpace, rid: str, ttl_s: int, background: set[asyncio.Task]) -> None:
    """Set the cancel key from a task of its own: the caller may itself be cancelled."""

    async def _cancel() -> None:
        try:
            await cancel.request_cancel(r, ks, rid, ttl_s)
        except Exception:
            log.warning("could not set cancel key request_id=%s", rid, exc_info=True)

    try:
        task = asyncio.get_running_loop().create_task(_cancel())
    except RuntimeError:  # no loop (interpreter shutting down)
        return
    background.add(task)
    task.add_done_callback(background.discard)
