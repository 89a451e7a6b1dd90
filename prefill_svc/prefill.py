"""Step 3 of a request's life in a prefill pod (the list is in prefill_svc/worker.py): the prefill
on the pod's one engine thread, and the writes that answer it — token `start_index` of every choice
and a ready notice for each choice that goes on, whose KV is then held in the KVStore.

It knows nothing of the admission entry: the writes it returns are committed with the entry's ack
by prefill_svc/commit.py, or dropped (and the KV freed) when that commit is fenced off.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from prefill_svc.kv_store import KVStore
from prefill_svc.settings import PrefillSettings
from tandem_core.bus import entry_fence, ready, token_stream
from tandem_core.grammar import Grammars
from tandem_core.bus import KeySpace
from tandem_core.sampling_args import first_finish, prefill_args
from tandem_core.types import GenerationRequest, encode_prompt_logprobs
from tandem_engine.api import PrefillCall

if TYPE_CHECKING:  # the types only: no JAX import
    from tandem_engine.api import ServingEngine
    from tandem_engine.prefix_pool import DevicePrefixCache

log = logging.getLogger(__name__)
_LOOKUP = object()  # prefill_sync's default: look the prompt up in the prefix cache


def _one_choice_args(req: GenerationRequest) -> dict:
    """`PrefillCall` keywords of a request with one choice and no grammar (prefill_args' others)."""
    kw = prefill_args(req)
    return {"start_index": kw["start_index"], "output_from": kw["output_from"], "stop_ids": kw["stop_ids"]}


class Prefiller:
    """The engine side of a prefill pod: one thread owns the device, and every engine call goes
    through it; the asyncio loop only awaits its results."""

    def __init__(self, settings: PrefillSettings, engine: ServingEngine, ks: KeySpace, store: KVStore, address: str,
                 worker_id: str, prefix_cache: DevicePrefixCache | None = None) -> None:
        self.s, self.engine, self.ks, self.store = settings, engine, ks, store
        self.address, self.worker_id = address, worker_id
        self.bounds = token_stream.StreamBounds.of(settings)
        # the KV of prefixes seen before (None: off, nothing looked up or counted)
        self.cache = prefix_cache
        self.device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-engine")
        # token 0 of a constrained request is masked too (compiled grammars: LRU, bounded)
        self.grammars = Grammars(engine.info, cache_size=settings.engine.grammar_cache_size,
                                 deadline_s=settings.engine.mask_deadline_s)
        self.max_prefix_bytes = self._max_prefix_bytes()
        # Shared by the loop and the engine thread, under `_lock`:
        self._lock = threading.Lock()
        self._queue: deque = deque()  # (request, future) waiting for the engine thread, oldest first
        self._running = False  # the engine thread is running calls (or about to start)
        self._arriving = 0  # claimed entries not yet queued (prefill) or done without a prefill
        self._closed = False
        self.engine_calls = 0  # engine-thread calls (a batch of prompts is one)
        self.prefilled = 0
        self.prefill_ema_s = 0.0  # recent per-prompt prefill time, for the gateway's TTFT prediction

    def _max_prefix_bytes(self) -> int:
        """The KV of one prompt in the largest bucket: what the budget check reserves per claim."""
        i = self.engine.info
        itemsize = 2 if self.s.engine.dtype == "bfloat16" else 4
        return 2 * i.num_layers * max(self.engine.buckets) * i.num_kv_heads * i.head_dim * itemsize

    def room(self) -> int:
        """How many more prompts the held-KV budget can take, each at the worst case."""
        return self.store.room_for(self.max_prefix_bytes)

    async def prefill(self, req: GenerationRequest, arrive=None) -> tuple[entry_fence.EntryWrites, list[str]]:
        """The writes that answer `req` and the ids of the KV now held for it (exceptions pass).

        The request joins the queue of prompts waiting for the engine thread; when the thread is
        free it takes the oldest and every other waiting prompt of the same bucket, up to
        `prefill_batch_tokens` padded tokens, and prefills them in one batched call. Nothing waits
        for company that is not here yet: only the entries already claimed (`expect`) are waited
        for, until each has reached this queue or dropped out (`arrive`, called once it is queued;
        `arrived`), a matter of their Redis checks' round trips."""
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._queue.append((req, done))
        if arrive is not None:
            arrive()
        self._kick()
        out = await done
        return self.first_writes(req, *out)

    def expect(self, count: int) -> None:
        """`count` claimed entries are on their way to the queue (each ends with `arrived`)."""
        with self._lock:
            self._arriving += count

    def arrived(self) -> None:
        """One expected entry is queued, or needs no prefill."""
        with self._lock:
            self._arriving -= 1
        self._kick()

    def _kick(self) -> None:
        """Start the engine thread's run of calls (on the next turn of the loop, so prompts queued
        in this one share its first call) if prompts wait, it is idle and no claimed entry is
        still on its way."""
        with self._lock:
            if not self._queue or self._running or self._arriving > 0:
                return
            self._running = True
        asyncio.get_running_loop().call_soon(self._dispatch)

    def _dispatch(self) -> None:
        """Hand the engine thread a run of calls (`_run_calls`); if it is shut down (the pod is
        stopping), fail what waits."""
        loop = asyncio.get_running_loop()
        try:
            self.device.submit(self._run_calls, loop)
        except RuntimeError as e:  # the engine thread is shut down
            with self._lock:
                self._running = False
            self._fail_waiting(e)

    def _run_calls(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the engine thread: engine calls back to back while prompts wait (and no claimed
        entry is still on its way), each call's results handed to the loop as it ends. The next
        call starts here, not after a round trip through the event loop: in a burst the loop is
        busy with the previous prompts' commits and KV pulls, and on shared cores each hop through
        it left the engine idle for a scheduler slice."""
        while True:
            with self._lock:
                if self._closed or not self._queue or self._arriving > 0:
                    self._running = False
                    return
                batch = self._next_batch()
                self.engine_calls += 1
            t0 = time.perf_counter()
            try:
                results = self.prefill_batch_sync([req for req, _ in batch])
            except BaseException as e:  # noqa: BLE001 - handed to every request of the call
                results = [e] * len(batch)
            took = time.perf_counter() - t0
            try:
                loop.call_soon_threadsafe(self._deliver, batch, results, took)
            except RuntimeError:  # the loop is closed: nobody waits for these any more
                with self._lock:
                    self._running = False
                return

    def _deliver(self, batch: list, results: list, took: float) -> None:
        """On the loop: one engine call's results to the requests that wait for them."""
        per_prompt = took / len(batch)
        self.prefill_ema_s = per_prompt if not self.prefilled else 0.8 * self.prefill_ema_s + 0.2 * per_prompt
        self.prefilled += len(batch)
        log.debug("prefilled %d prompt(s) in one call in %.1f ms", len(batch), took * 1e3)
        for (_, done), res in zip(batch, results):
            if done.done():
                continue
            if isinstance(res, asyncio.CancelledError):
                done.cancel()
            elif isinstance(res, BaseException):
                done.set_exception(res)
            else:
                done.set_result(res)

    def _fail_waiting(self, e: BaseException) -> None:
        """On the loop: every prompt still queued fails with `e` (the engine thread is gone)."""
        with self._lock:
            waiting, self._queue = list(self._queue), deque()
        for _, done in waiting:
            if not done.done():
                done.set_exception(e)

    def _next_batch(self) -> list:
        """The oldest waiting prompt, and with it the next waiting prompts of its bucket that can
        share its call (one choice, no grammar), up to `prefill_batch_tokens` padded tokens.
        (Under `_lock`.)"""
        head_req, _ = head = self._queue.popleft()
        bucket = self._batch_bucket(head_req)
        if bucket is None:
            return [head]
        batch, rest = [head], deque[tuple]()
        while self._queue:
            item = self._queue.popleft()
            if (len(batch) + 1) * bucket <= self.s.prefill_batch_tokens and self._batch_bucket(item[0]) == bucket:
                batch.append(item)
            else:
                rest.append(item)
        self._queue = rest
        return batch

    def _batch_bucket(self, req: GenerationRequest) -> int | None:
        """The bucket a request batches in, or None if it runs alone (several choices, a grammar,
        prompt logprobs, a prompt no bucket fits)."""
        if req.n > 1 or req.grammar is not None or req.prompt_logprobs is not None:
            return None
        n = len(req.prompt_ids)
        return next((b for b in self.engine.buckets if b >= n), None)

    def prefill_batch_sync(self, reqs: list[GenerationRequest]) -> list:
        """On the engine thread: each request's `prefill_sync` result, or the exception that failed
        it. Prompts that miss the prefix cache run in one `engine.prefill_batch`; a prompt over a
        cached prefix runs alone over it. If the batched call fails, its prompts run again one at a
        time, so one bad prompt fails alone."""
        if len(reqs) == 1:
            return [self._settle(self.prefill_sync, reqs[0])]
        out: list = [None] * len(reqs)
        plain = []
        for i, req in enumerate(reqs):
            hit = self._lookup(req.prompt_ids)
            if hit is None:
                plain.append(i)
            else:
                out[i] = self._settle(self.prefill_sync, req, hit)
        if plain:
            calls = [PrefillCall(reqs[i].prompt_ids, reqs[i].sampling, **_one_choice_args(reqs[i])) for i in plain]
            try:
                prefixes = self.engine.prefill_batch(calls)
            except Exception as e:  # noqa: BLE001 - each prompt again alone: the bad one fails by itself
                log.info("batched prefill of %d prompts failed (%s: %s); running them one at a time", len(plain),
                         type(e).__name__, e)
                for i in plain:
                    out[i] = self._settle(self.prefill_sync, reqs[i], None)
                return out
            for i, prefix in zip(plain, prefixes):
                out[i] = self._settle(self._finish_sync, reqs[i], prefix, None)
        return out

    @staticmethod
    def _settle(fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - handed to the request's own handler
            return e

    def _lookup(self, ids):
        """The prefix cache's hit for a prompt (None without a cache, or on a miss)."""
        return None if self.cache is None else self.cache.lookup(ids)

    def prefill_sync(self, req: GenerationRequest, hit=_LOOKUP):
        """On the engine thread: (payload, per-choice first tokens and their logprobs, encoded
        prompt logprobs or None). `hit`: the prefix-cache lookup already made (default: look up)."""
        if hit is _LOOKUP:
            hit = self._lookup(req.prompt_ids)
        try:  # (a grammar that cannot run fails here, before the engine)
            kw = prefill_args(req, self.grammars)
        except BaseException:
            if hit is not None:  # a hit pins its blocks until its prefill runs
                hit.cache.release(hit)
            raise
        prefix = self.engine.prefill(req.prompt_ids, req.sampling, cached=hit, **kw)
        return self._finish_sync(req, prefix, hit)

    def _finish_sync(self, req: GenerationRequest, prefix, hit):
        """The prefix's KV to the host, its new blocks cached, its prompt logprobs if asked."""
        payload = self.engine.export_prefix(prefix)
        if self.cache is not None:
            self.cache.stats.computed += len(req.prompt_ids) - (hit.length if hit else 0)
            self.cache.insert(req.prompt_ids, lambda: (prefix.k, prefix.v))  # on the device, as it ran
        prompt_lp = None
        if req.prompt_logprobs is not None and req.start_index == 0:
            prompt_lp = encode_prompt_logprobs(self.engine.prompt_logprobs(req.prompt_ids, req.prompt_logprobs))
        return payload, prefix.first_tokens, prefix.first_logprobs, prompt_lp

    def first_writes(self, req: GenerationRequest, payload, firsts, logprobs,
                     prompt_lp) -> tuple[entry_fence.EntryWrites, list[str]]:
        """Token `start_index` of every choice, and a ready notice for each choice that goes on; the
        KV is held for those. All in one commit: a choice's token is in its stream if and only if
        its ready notice is (or its finish), so a reclaimed admission entry can tell whether its
        first owner got this far, and a fenced-off commit leaves no half of it behind."""
        at, b = req.start_index, self.bounds
        choices = [req] if req.n <= 1 else [req.choice(i) for i in range(req.n)]
        writes = entry_fence.EntryWrites()
        if prompt_lp is not None:
            token_stream.add_prompt_logprobs(writes, self.ks, choices[0].request_id, prompt_lp, b.ttl_s, b.maxlen)
        going = []
        for c, first, lp in zip(choices, firsts, logprobs):
            reason = first_finish(c, first, payload.true_length, self.engine.max_len)
            token_stream.add_tokens(writes, self.ks, c.request_id, at, [first], reason, b.ttl_s, b.maxlen,
                                    finished_ttl_s=b.finished_ttl_s, logprobs=[lp])
            if reason is None:
                going.append((c, first))
        if not going:
            return writes, []
        held = self.store.put_shared([c.request_id for c, _ in going], payload)
        for (c, first), h in zip(going, held):
            notice = ready.ReadyNotice(
                request=c, address=self.address, capability=h.capability, kv_bytes=payload.nbytes,
                prefill_worker=self.worker_id, first_token=first,
            )
            ready.add_ready(writes, self.ks, self.s.pool, notice, self.s.ready_maxlen)
        return writes, [h.request_id for h in held]

    def close(self) -> None:
        """Stop the engine thread after its current call; prompts still queued fail (on the loop)."""
        with self._lock:
            self._closed = True
        self.device.shutdown(wait=False, cancel_futures=True)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop here: nobody awaits the queued prompts
            return
        self._fail_waiting(RuntimeError("the prefill engine thread is shut down (the pod is stopping)"))
