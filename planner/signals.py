"""The planner's view of the cluster, read from Redis once per interval.

- Load: the gateways' cumulative counts (tandem_core/load_report.py), turned into this
  interval's increments: requests admitted and their mean prompt length (all of them, which size
  decode, and those routed to prefill pods, which size prefill), requests finished and their mean
  output length, mean TTFT and ITL.
- Backlogs: admission entries not yet prefilled (the shared streams of every priority, the direct
  stream and every pod's own stream, as the gateway counts them) and prefilled requests waiting
  for a decode slot (the ready stream); pods XDEL what they ack, so XLEN is the backlog.
- Pods: the live, non-draining prefill and decode pods of this pool in the registry, and what
  their heartbeats report of their throughput (prompts prefilled, tokens decoded, a prefill pod's
  recent seconds a prompt), published beside the decision so the profile can be checked; and
  the live decode pods' KV capacity (rows, and a paged pod's block pool: planner/kv.py), which
  bounds the batch a decode pod is sized at. No decode pod live: None, and decode is sized by the
  ITL target alone.
The first read only sets the baseline of the counts; every later one is an `Observation`.
"""
from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from planner.decide import Observation
from planner.kv import KVCapacity, pod_capacity, pool_capacity
from tandem_core import load_report
from tandem_core.bus import admission, ready, registry
from tandem_core.bus import KeySpace


class NoSignal(RuntimeError):
    """The cluster's signals are missing (no gateway reports its load); the planner holds."""


@dataclass(frozen=True)
class Snapshot:
    observation: Observation | None  # None on the first read (the baseline)
    live: dict[str, int]  # role -> live, non-draining pods of the pool
    gateways: int


@dataclass(frozen=True)
class PodReport:
    """The pool's pods as the registry has them, read once a tick."""

    live: dict[str, int]  # role -> live, non-draining pods
    done: dict[str, float]  # since the last read: prompts prefilled, tokens decoded; prefill_s: seconds a prompt
    kv: KVCapacity | None  # the live decode pods' KV (the smallest pod's; planner/kv.py)


class Signals:
    def __init__(self, r: aioredis.Redis, ks: KeySpace, pool: str) -> None:
        self.r, self.ks, self.pool = r, ks, pool
        self.increments = load_report.Increments()
        self.pod_increments = load_report.Increments(("prefilled", "tokens"))
        self.last_t: float | None = None

    async def backlogs(self) -> tuple[int, int]:
        """(admission entries not yet prefilled, prefilled requests waiting for a decode slot)."""
        owners = await admission.pod_stream_owners(self.r, self.ks, self.pool)
        pipe = self.r.pipeline(transaction=False)
        for prio in admission.PRIORITIES:
            for wid in owners:
                for shard in self.ks.all_shards():
                    pipe.xlen(self.ks.pod_admission_stream(self.pool, prio, wid, shard))
        routed = sum(int(x) for x in await pipe.execute())
        return (await admission.admission_backlog(self.r, self.ks, self.pool) + routed,
                await ready.ready_backlog(self.r, self.ks, self.pool))

    async def pods(self) -> PodReport:
        """The live non-draining pods per role, what the pool's pods did since the last read
        (prompts prefilled, tokens decoded, the prefill pods' mean recent seconds a prompt) and the
        live decode pods' KV capacity (a draining pod's is not counted: it takes no new work)."""
        live, reps, ema, kv = {"prefill": 0, "decode": 0}, [], [], []
        for w in await registry.list_workers(self.r):
            extra = w.get("extra") or {}
            if w["role"] not in live or extra.get("pool", self.pool) != self.pool:
                continue
            live[w["role"]] += 0 if w.get("draining") else 1
            reps.append({"id": w["id"], "pid": w["pid"], "prefilled": extra.get("prefilled", 0),
                         "tokens": extra.get("tokens", 0)})
            if w["role"] == "prefill" and extra.get("prefill_ema_s"):
                ema.append(float(extra["prefill_ema_s"]))
            if w["role"] == "decode" and not w.get("draining"):
                cap = pod_capacity(int(w.get("slots", 0)), int(w.get("free_slots", 0)), extra)
                if cap is not None:
                    kv.append(cap)
        done = self.pod_increments.step(reps)
        return PodReport(live, {**done, "prefill_s": sum(ema) / len(ema) if ema else 0.0}, pool_capacity(kv))

    async def read(self, t: float) -> Snapshot:
        reports = await load_report.read(self.r)
        d = self.increments.step(reports)
        pods = await self.pods()
        live, done = pods.live, pods.done
        if self.last_t is None:
            self.last_t = t
            return Snapshot(None, live, len(reports))
        # the counts cover the span between each gateway's two reports, not exactly the interval
        wall, self.last_t = max(1e-3, t - self.last_t), t
        interval = max(1e-3, d["span_s"] or wall)
        if not reports:
            raise NoSignal("no gateway has reported its load for 10 s or more (tandem:gateways is empty): "
                           "is a gateway running against this Redis?")
        prefill_backlog, decode_backlog = await self.backlogs()
        obs = Observation(
            t=t, interval_s=interval, arrivals=int(round(d["admitted"])),
            prompt_tokens_mean=_mean(d["prompt_tokens"], d["admitted"]),
            output_tokens_mean=_mean(d["output_tokens"], d["finished"]),
            prefill_backlog=prefill_backlog, decode_backlog=decode_backlog,
            ttft_mean_s=_mean(d["ttft_sum"], d["ttft_count"]), itl_mean_s=_mean(d["itl_sum"], d["itl_count"]),
            prefill_arrivals=int(round(d["admitted_remote"])),
            prefill_prompt_tokens_mean=_mean(d["prompt_tokens_remote"], d["admitted_remote"]),
            prefilled_per_s=done["prefilled"] / wall, decoded_tokens_per_s=done["tokens"] / wall,
            prefill_seconds_seen=done["prefill_s"] or None, kv=pods.kv,
        )
        return Snapshot(obs, live, len(reports))


def _mean(total: float, n: float) -> float | None:
    return total / n if n > 0 else None
