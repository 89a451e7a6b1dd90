"""Wiring of one decode pod in the shared worker skeleton (tandem_core/worker_pod.py): the engine
thread (decode_svc/loop.py) and the I/O side (decode_svc/io.py) around one request table and one
bridge; readiness only once the engine is compiled; a drain on SIGTERM."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from typing import TYPE_CHECKING

from decode_svc.blocks import BlockBudget
from decode_svc.bridge import Bridge
from decode_svc.io import DecodeIO
from decode_svc.loop import EngineLoop
from decode_svc.recover import reclaim_pending, recover_loop, recover_running
from decode_svc.requests import RequestTable
from decode_svc.settings import DecodeSettings
from tandem_core.bus import conn, groups, registry
from tandem_core.bus import KeySpace
from tandem_core.settings import default_worker_id
from tandem_core.worker_pod import WorkerPod

if TYPE_CHECKING:  # the type only: no JAX import
    from tandem_engine.api import ServingEngine
    from tandem_engine.draft import DraftProposer

log = logging.getLogger(__name__)
SERVICE = "tandem.v1.Decode"
REDIS_CLIENT_NAME = "tandem-decode"  # every connection of a decode pod, as CLIENT LIST shows it


def build_engine(s: DecodeSettings) -> ServingEngine:
    from tandem_engine import load_engine

    return load_engine(**s.engine_kwargs(s.slots))


def build_draft(s: DecodeSettings, engine: ServingEngine) -> DraftProposer | None:
    """Speculative method "draft": the draft model as an Engine of its own beside the target, with
    the target's slots, max_len, dtype and tp, its own KV pool (a row's whole context a slot), no
    block reuse, and k - 1 steps a call (tandem_engine/draft.py); whole on one chip where its heads
    do not split over the target's tp. ModelNotFound (a configuration error) when it cannot propose
    for the target (another tokenizer: `serve` checks that before any compile). None for the other
    methods."""
    sp = s.speculative
    if sp.method != "draft":
        return None
    from tandem_core.models import resolve_model
    from tandem_engine import load_engine
    from tandem_engine.draft import DraftProposer, check_draft

    kw = {**s.engine_kwargs(s.slots), "model": sp.draft_model, "kv_reuse": False, "kv_blocks": None,
          "steps_per_dispatch": max(1, sp.k - 1), "quantize": None}
    info, tp = resolve_model(sp.draft_model), engine.tp  # the target's tp (0 in the settings: every chip)
    kw["tp"] = tp
    if tp > 1 and (info.num_kv_heads % tp or info.intermediate_size % tp):
        log.info("speculative: the draft model %s (%d KV heads) does not split over tp=%d: it runs whole on one chip",
                 info.name, info.num_kv_heads, tp)
        kw["tp"] = 1
    t0 = time.monotonic()
    draft = load_engine(**kw)
    check_draft(engine.info, draft.info)
    proposer = DraftProposer(draft, sp.k, sample=sp.draft_sample)
    log.info("speculative: draft model %s (%d layers, hidden %d, KV %d blocks) loaded in %.1fs; its %d shapes "
             "compile in idle time, speculation starts after them", draft.info.name, draft.info.num_layers,
             draft.info.hidden_size, draft.kv_blocks_total, time.monotonic() - t0, len(proposer.warm_items()))
    return proposer


async def _compiled_engine(s: DecodeSettings):
    """The engine with every decode shape but the grammar-masked ones compiled (those follow in
    the engine thread's idle time: EngineLoop.late_warm), not on a request's clock (and every prefill
    when this pod prefills all its prompts; with direct prefill the smallest bucket's, where the
    gateway's short prompts fall): readiness waits for it. JAX's persistent compilation cache makes restarts quick."""
    engine = build_engine(s)
    t0 = time.monotonic()
    last = [0.0]

    def progress(done: int, total: int, seconds: float) -> None:  # the warm-up thread's
        if done == total or seconds - last[0] >= 10.0:
            last[0] = seconds
            log.info("warm-up: %d/%d decode step variants compiled, %.1fs", done, total, seconds)

    # plain and logprobs steps (one compiled step); colocated: every prefill bucket and the ragged call (a
    # prompt seated over the pool's kept blocks, a conversation's next turn; long prompts' chunks
    # beside the steps); a disaggregated pod with direct_prefill: the smallest bucket's prefill, the
    # gateway's direct prompts (so short, ~16 tokens, that they seldom hold a whole kept block: a
    # hit there compiles the ragged call on its first use)
    ragged = s.colocated and (engine.kv_reuse or s.prefill_chunk_tokens > 0)
    # (the grammar-masked steps are left to the engine thread's idle time after the pod is ready:
    # EngineLoop.late_warm; 5 of the 15 variants at 32 rows)
    steps = await asyncio.to_thread(engine.warmup, prefill=s.colocated, logprobs=True, masks=False, progress=progress,
                                    direct=s.direct_prefill, ragged=ragged)
    log.info("engine compiled in %.1fs (prefill buckets %s, batch buckets %s, %d decode step variants; KV %d blocks "
             "of %d)", time.monotonic() - t0, list(engine.buckets), list(engine.batch_buckets), steps,
             engine.kv_blocks_total, engine.kv_block_size)
    if engine.windowed:
        log.info("KV: %d windowed layers of %d keep at most %d blocks a row in a group of their own (their "
                 "window, not max_len; engine.kv_window_group)%s", sum(engine.windowed), len(engine.windowed),
                 engine.window_span, "; a finished sequence's blocks are reused by one that matches them to their end"
                 if engine.kv_reuse else "")
    return engine


async def serve(s: DecodeSettings) -> int:
    worker_id = s.worker_id or default_worker_id("decode")
    if s.speculative.method == "draft":  # a draft that cannot propose for this model stops the pod before any compile
        from tandem_core.models import resolve_model
        from tandem_engine.draft import check_draft

        check_draft(resolve_model(s.engine.model), resolve_model(s.speculative.draft_model))
    engine = await _compiled_engine(s)
    draft = await asyncio.to_thread(build_draft, s, engine)
    # Everything alive after the compile (JAX's and the model's objects: millions) is moved out of
    # the collector's reach: otherwise a full collection walks them all, measured at up to 1.8 s of
    # one thread holding the GIL in the middle of serving (bench/host_path.py --profile), every
    # Python thread of the pod stalled behind it.
    gc.collect()
    gc.freeze()
    r = conn.connect(s.redis, client_name=REDIS_CLIENT_NAME)
    ks = KeySpace(s.redis.shard_count())
    await groups.ensure_groups(r, ks, s.pool)
    table = RequestTable(s.slots)
    drafted = draft is not None and draft.sample  # its verify calls take the proposals' distributions
    bridge = Bridge(max(s.insert_queue_size, s.slots), s.output_queue_size, asyncio.get_running_loop())
    blocks = BlockBudget.of(engine, s.kv_reserve_steps or None)  # capacity in KV blocks too
    engine_loop = EngineLoop(engine, table, bridge, grammar_cache_size=s.engine.grammar_cache_size,
                             mask_deadline_s=s.engine.mask_deadline_s, prefill_chunk_tokens=s.prefill_chunk_tokens, blocks=blocks,
                             late_warm=[v for v in engine.warm_steps(masks=True) if v.masked]
                             + (engine.verify_variants(s.speculative.k, drafted=drafted) if s.speculative.on else [])
                             + (draft.warm_items() if draft is not None else [])
                             + (engine.verify_variants(s.speculative.k, masked=True, drafted=drafted)
                                if s.speculative.on else []),
                             speculative=s.speculative, draft=draft)
    io = DecodeIO(s, r, ks, table, engine_loop, bridge, worker_id)
    await conn.retry_redis(io.owned.load, "load publish script", log=log)
    await io.claims.ensure_own_groups()  # (its per-pod ready streams: cache-aware routing)
    pod = WorkerPod(s, r, [SERVICE])
    address = pod.bind()
    await pod.start()
    engine_loop.start()
    done = asyncio.Event()  # the drain is over: publishing, cancels and recovery stop only then
    pod.beat(_worker_info(s, io, worker_id, address, pod), io.peers, io.resync.kick)
    tasks = [pod.supervise(asyncio.create_task(io.publisher.publish_loop(done)), "the publish loop"),
             pod.supervise(asyncio.create_task(io.cancel_loop(done)), "the cancel loop")]
    # A restart under the same id: first resume what the previous incarnation left behind.
    # (through a Redis blip: a failure here ended the start, and the restart met the same blip)
    await conn.retry_redis(lambda: recover_running(io, include_self=True), "recover this pod's running requests",
                           log=log)
    await conn.retry_redis(lambda: reclaim_pending(io, include_self=True), "reclaim this pod's pending entries",
                           log=log)
    tasks += [pod.supervise(asyncio.create_task(recover_loop(io, done)), "the recovery loop"),
              pod.supervise(asyncio.create_task(_watch_engine(engine_loop, pod.stop)), "the engine watch")]
    # A claim loop that died would leave a pod heartbeating with free slots that claims nothing.
    claim = pod.supervise(asyncio.create_task(io.claims.claim_loop(pod.stop)), "the claim loop")
    await pod.ready()
    log.info("decode ready worker_id=%s slots=%d model=%s tp=%d kv=%s", worker_id, s.slots, engine.info.name, engine.tp,
             f"{blocks.total} blocks of {blocks.block_size} (reserve {blocks.per_row} a row)")
    await pod.stop.wait()
    await pod.drain()
    await asyncio.gather(claim, return_exceptions=True)  # (a failure was said by `supervise`: drain on)
    await _drain(io, s.drain_timeout_s)
    engine_loop.stop()
    done.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await io.puller.close()
    await pod.close(grace_s=1.0)
    log.info("decode stopped worker_id=%s steps=%d tokens=%d handed_back_for_blocks=%d", worker_id,
             engine_loop.stats.steps, engine_loop.stats.tokens, engine_loop.stats.handed_back_for_blocks)
    if pod.failed:
        log.error("decode pod exits after a failure: %s", "; ".join(pod.failed))
    return 1 if engine_loop.error or pod.failed else 0


def _worker_info(s: DecodeSettings, io: DecodeIO, worker_id: str, address: str, pod: WorkerPod):
    """What each heartbeat publishes about this pod (the registry; the gateway routes on it)."""
    table, stats = io.table, io.engine_loop.stats

    def info() -> registry.WorkerInfo:
        return registry.WorkerInfo(
            role="decode", id=worker_id, pid=os.getpid(), address=address, slots=table.slots,
            free_slots=table.free, draining=pod.draining,
            extra={"pool": s.pool, "prefix_cache": prefix_cache(), "steps": stats.steps,
                   "calls": stats.calls, "single_calls": stats.single_calls, "tokens": stats.tokens, "cancelled": stats.cancelled + io.claims.cancelled,
                   "cancel_lag_tokens": stats.cancel_lag_tokens, "handed_back": io.handback.handed_back,
                   "owed": io.handback.owed, "pulled": io.claims.pulled, "superseded": io.claims.superseded,
                   "pulled_kv_bytes": io.claims.pulled_kv_bytes, "local_prefills": stats.local_prefills,
                   "colocated": s.colocated, "requests": table.stages(),
                   # gateways steer conversations only to pods that say they read their own ready stream
                   "ready_affinity": io.claims.affinity,
                   "stolen": 0 if io.claims.stealer is None else io.claims.stealer.stolen,
                   # the step variants the warm-up left to idle time (the grammar-masked ones)
                   "late_compiles": {"done": stats.late_compiled, "total": stats.late_compiles,
                                     "seconds": round(stats.late_compile_s, 1)},
                   # speculative decoding's counts (the gateway's vllm:spec_decode_* counters); None: off
                   "speculative": None if io.engine_loop.spec is None else io.engine_loop.spec.summary(),
                   **kv_info()},
        )

    def prefix_cache() -> dict:
        """The pool's block cache in the prefill pods' `prefix_cache` shape (the gateway's
        `vllm:prefix_cache_*` counters, /admin/cluster), for the prompts this pod prefills itself
        (colocated, routed direct): queries and hits in their prompt tokens, `computed` what it
        prefilled. A pulled prompt is counted once in the cluster, by the prefill pod that
        prefilled it: the pull's reuse of the pool's blocks is `extra.kv_reuse` (its
        `reused_tokens`). The blocks are pool blocks, under no budget of their own."""
        engine = io.engine_loop.engine
        reuse = engine.kv_reuse_summary() or {}
        return {"enabled": reuse != {}, "block_size": engine.kv_block_size, "queries": stats.prompt_queries,
                "hits": stats.prompt_hits, "computed": stats.prompt_computed, "blocks": reuse.get("blocks", 0),
                "evicted": reuse.get("evicted", 0), "bytes": 0, "budget_bytes": 0, "hit_copy_bytes": 0}

    def kv_info() -> dict:
        """The KV pool's blocks (free_slots stays rows)."""
        blocks = io.engine_loop.blocks
        reuse = io.engine_loop.engine.kv_reuse_summary()
        if reuse is not None:
            reuse["reused_tokens"] = io.claims.reused_tokens
        return {"kv": blocks.summary(), "handed_back_for_blocks": stats.handed_back_for_blocks, "kv_reuse": reuse}
    return info


async def _watch_engine(engine_loop: EngineLoop, stop: asyncio.Event) -> None:
    while not stop.is_set():
        if engine_loop.error is not None:
            log.error("engine thread failed: %r; stopping", engine_loop.error)
            stop.set()
            return
        await asyncio.sleep(0.2)


async def _drain(io: DecodeIO, timeout_s: float) -> None:
    """Finish running requests (and those on their way to a slot) before exiting, within `timeout_s`."""
    table = io.table
    deadline = time.monotonic() + timeout_s
    while (table.used or table.pending) and time.monotonic() < deadline:
        if io.engine_loop.error is not None:
            break
        await asyncio.sleep(0.05)
    if table.used:
        # Hand them back: each resumes on another pod from what it has streamed so far.
        left = table.snapshot()
        failed = io.engine_loop.error is not None
        why = "its engine thread failed" if failed else "the drain deadline passed"
        log.warning("%s with %d running requests: handing them back", why, len(left))
        for act in left:
            try:
                await io.resume(act.req, f"decode pod stopped before it finished ({why})", owner=io.worker_id)
                if act.ack is not None:  # a seated prompt's entry, acked with its first token: resumed instead
                    await io.handback.ack(*act.ack)
            except Exception as e:  # noqa: BLE001 - Redis away: the next start resumes it from the running hash
                log.warning("handing back request_id=%s failed (%s): left for this pod's next start", act.req.request_id, e)
        io.engine_loop.cancel({a.req.request_id for a in left}, silent=True)
