"""Step 3 of a request's life in a prefill pod (the list is in prefill_svc/worker.py): the prefill
on the pod's one engine thread, and the writes that answer it — token `start_index` of every choice
and a ready notice for each choice that goes on, whose KV is then held in the KVStore.

It knows nothing of the admission entry: the writes it returns are committed with the entry's ack
by prefill_svc/commit.py, or dropped (and the KV freed) when that commit is fenced off.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from prefill_svc.kv_store import KVStore
from prefill_svc.settings import PrefillSettings
from tandem_core.bus import entry_fence, ready, token_stream
from tandem_core.grammar import Grammars
from tandem_core.bus import KeySpace
from tandem_core.sampling_args import first_finish, prefill_args
from tandem_core.types import GenerationRequest, encode_prompt_logprobs
from tandem_engine.prefix_cache import PrefixCache
from tandem_engine.prefix_cache import prefill as cached_prefill

if TYPE_CHECKING:  # the type only: no JAX import
    from tandem_engine.api import ServingEngine

log = logging.getLogger(__name__)


class Prefiller:
    """The engine side of a prefill pod: one thread owns the device, and every engine call goes
    through it; the asyncio loop only awaits its results."""

    def __init__(self, settings: PrefillSettings, engine: ServingEngine, ks: KeySpace, store: KVStore, address: str,
                 worker_id: str, prefix_cache: PrefixCache | None = None) -> None:
        self.s, self.engine, self.ks, self.store = settings, engine, ks, store
        self.address, self.worker_id = address, worker_id
        self.bounds = token_stream.StreamBounds.of(settings)
        # the KV of prefixes seen before (None: off; only the prefill tokens computed are counted)
        self.cache = prefix_cache if prefix_cache is not None else PrefixCache(1, 0, enabled=False)
        self.device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-engine")
        # token 0 of a constrained request is masked too (compiled grammars: LRU, bounded)
        self.grammars = Grammars(engine.info, cache_size=settings.engine.grammar_cache_size,
                                 deadline_s=settings.engine.mask_deadline_s)
        self.max_prefix_bytes = self._max_prefix_bytes()
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

    async def prefill(self, req: GenerationRequest) -> tuple[entry_fence.EntryWrites, list[str]]:
        """The writes that answer `req` and the ids of the KV now held for it (exceptions pass)."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        out = await loop.run_in_executor(self.device, self.prefill_sync, req)
        took = time.perf_counter() - t0
        self.prefill_ema_s = took if not self.prefilled else 0.8 * self.prefill_ema_s + 0.2 * took
        self.prefilled += 1
        log.debug("prefilled request_id=%s len=%d n=%d in %.1f ms", req.request_id, len(req.prompt_ids), req.n,
                  took * 1e3)
        return self.first_writes(req, *out)

    def prefill_sync(self, req: GenerationRequest):
        """On the engine thread: (payload, per-choice first tokens and their logprobs, encoded
        prompt logprobs or None)."""
        prefix, payload = cached_prefill(self.engine, self.cache, req.prompt_ids, req.sampling, export=True,
                                         **prefill_args(req, self.grammars))
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
        self.device.shutdown(wait=False, cancel_futures=True)
