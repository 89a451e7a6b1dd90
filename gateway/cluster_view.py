"""What the gateway knows of the cluster: the live workers (`ClusterView`, which admission and
routing decide by), `/admin/cluster`, `/readyz`, and the Gateway API Inference Extension's load
gauges, refreshed from Redis before a scrape (`ClusterReport`)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.hold import RedisHold
from gateway.metrics import GatewayMetrics, cluster_load, prefix_cache_summary
from gateway.prefix_route import prefix_route_pods
from gateway.settings import GatewaySettings
from tandem_core.bus import admission, conn, ready, registry
from tandem_core.errors import ServiceUnavailable
from tandem_core.bus import KeySpace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeRoom:
    """What one live decode pod can take now: free rows, and on a paged pod its free KV blocks
    (`blocks_free` None on the slot layout, where a free row holds max_len positions)."""

    free_slots: int
    blocks_free: int | None = None
    block_size: int = 16
    worker_id: str = ""
    affinity: bool = False  # it reads its per-pod ready stream: cache-aware routing may steer to it

    def takes(self, prompt_tokens: int) -> int:
        """Prompts of `prompt_tokens` this pod has room for now (rows, and blocks for each prompt)."""
        if self.blocks_free is None:
            return self.free_slots
        return min(self.free_slots, self.blocks_free // max(1, -(-prompt_tokens // max(1, self.block_size))))

    @classmethod
    def of(cls, w: dict) -> "DecodeRoom":
        extra = w.get("extra") or {}
        kv = extra.get("kv") or {}
        who = {"worker_id": str(w.get("id") or ""), "affinity": extra.get("ready_affinity") is True}
        if kv.get("layout") == "paged":
            return cls(int(w["free_slots"]), int(kv.get("blocks_free", 0)), int(kv.get("block_size", 16)), **who)
        return cls(int(w["free_slots"]), **who)


@dataclass(frozen=True)
class ClusterView:
    prefill_workers: int = 0
    decode_workers: int = 0
    decode_free_slots: int = 0
    prefill_s: float = 0.0  # mean of the prefill workers' recent per-prompt prefill time
    prefill_ids: tuple[str, ...] = ()  # live prefill pods that take per-pod entries (prefix_route_pods)
    decode_rooms: tuple[DecodeRoom, ...] = ()  # per live decode pod (empty: `decode_free_slots` says all)

    def decode_room_for(self, prompt_tokens: int) -> int:
        """Prompts of this length the live decode pods can take now: free rows, and on paged pods
        the blocks for the prompt too (a free row with no free blocks takes nothing)."""
        if not self.decode_rooms:
            return self.decode_free_slots
        return sum(r.takes(prompt_tokens) for r in self.decode_rooms)

    @classmethod
    def of(cls, workers: list[dict], pool: str | None = None) -> "ClusterView":
        live = [w for w in workers if not w.get("draining")]
        pre = [w for w in live if w["role"] == "prefill"]
        dec = [w for w in live if w["role"] == "decode"]
        times = [float(w.get("extra", {}).get("prefill_ema_s") or 0) for w in pre]
        times = [t for t in times if t > 0]
        return cls(len(pre), len(dec), sum(int(w["free_slots"]) for w in dec),
                   sum(times) / len(times) if times else 0.0, prefix_route_pods(pre, pool),
                   tuple(DecodeRoom.of(w) for w in dec))


class ClusterReport:
    """/readyz, /admin/cluster and the load gauges, read from Redis (`redis()` raises
    ServiceUnavailable before the gateway has a client)."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics, model_name: str,
                 redis: Callable[[], aioredis.Redis], ks: KeySpace, hold: RedisHold) -> None:
        self.settings, self.metrics, self.model_name = settings, metrics, model_name
        self.redis, self.ks, self.hold = redis, ks, hold
        self.load_ts = -1e9  # when the load gauges were last refreshed (monotonic)

    async def ready(self) -> str:
        """"ready"; "degraded" while Redis has not answered for less than redis_hold_s (new
        requests wait for it); "not ready" after that, or before the gateway has a Redis client."""
        try:
            if await asyncio.wait_for(self.redis().ping(), timeout=2.0):
                self.hold.note_ok()
                return "ready"
        except ServiceUnavailable:
            return "not ready"
        except (asyncio.TimeoutError, *conn.REDIS_DOWN):
            pass
        self.hold.note_down()
        return "degraded" if self.hold.degraded else "not ready"

    async def cluster(self) -> dict:
        r = self.redis()
        s = self.settings
        try:
            workers = await registry.list_workers(r)
            queued = await admission.read_backlog(r, self.ks, s.pool, ClusterView.of(workers, s.pool).prefill_ids)
            ready_n = await ready.ready_backlog(r, self.ks, s.pool)
        except conn.REDIS_DOWN as e:
            raise ServiceUnavailable(f"Redis is unreachable: {e}; retry in a few seconds") from e
        backlog = queued.total
        self.metrics.backlog.set(backlog)
        self.metrics.observe_prefix_cache(workers)
        waiting, running, kv = cluster_load(workers, backlog, ready_n)
        self.metrics.set_load(self.model_name, waiting, running, kv)
        return {
            "workers": workers,
            "load": {"waiting": waiting, "running": running, "kv_cache_usage": round(kv, 4)},
            "queues": {"pool": s.pool, "admission": queued.shared, "pod_admission": queued.pods,
                       "admission_backlog": backlog, "ready": ready_n, "direct": queued.direct,
                       "admission_max_backlog": s.admission_max_backlog},
            "prefix_cache": prefix_cache_summary(workers, s.prefix_block_size),
            "model": {"name": self.model_name, "model": s.model, "max_context_len": s.max_context_len,
                      "max_prompt_len": s.max_prompt_len},
        }

    async def refresh_load(self, timeout_s: float = 1.0) -> None:
        """Update the inference-extension gauges from Redis before a scrape, at most every
        cluster_view_ttl_s (endpoint pickers scrape every 50 ms); on failure they keep their last
        values (a scrape must not fail because Redis is slow)."""
        now = time.monotonic()
        if now - self.load_ts < self.settings.cluster_view_ttl_s:
            return
        self.load_ts = now

        async def read() -> None:
            r = self.redis()
            workers = await registry.list_workers(r)
            pods = ClusterView.of(workers, self.settings.pool).prefill_ids
            backlog = await admission.total_backlog(r, self.ks, self.settings.pool, pods)
            ready_n = await ready.ready_backlog(r, self.ks, self.settings.pool)
            self.metrics.backlog.set(backlog)
            self.metrics.observe_prefix_cache(workers)
            self.metrics.set_load(self.model_name, *cluster_load(workers, backlog, ready_n))

        try:
            await asyncio.wait_for(read(), timeout=timeout_s)
        except (asyncio.TimeoutError, *conn.REDIS_DOWN, ServiceUnavailable) as e:
            log.debug("load gauges not refreshed: %s", e)
