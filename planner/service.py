"""The planner's loop: once per interval, observe, decide, act, publish.

Order of one tick: refresh the Lease (mode kubernetes) -> read the signals from Redis -> read
the replicas running -> `Planner.step` -> apply (only the leader, only a decision, not a hold)
-> gauges and /decision. Whatever fails (a bad profile, Redis, the API server, missing signals,
an SLO no replica count meets) becomes a *hold*: the replicas stay as they are, the log says why
(once per new reason) and `tandem_planner_holding` is 1. A planner never scales on a guess.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque

from redis.exceptions import RedisError

from planner.connectors import KubeScale, LocalFollow, Publish
from planner.correct import Corrections
from planner.decide import ROLES, Decision, PlanConfig, Planner
from planner.kube import KubeApi, LeaseKeeper, RecordingApi, default_identity, default_namespace
from planner.metrics import PlannerMetrics, hold_kind
from planner.predict import LoadPredictor
from planner.profile import ProfileError, load_profile
from planner.settings import PlannerSettings
from planner.signals import NoSignal, Signals
from tandem_core.bus import KeySpace

log = logging.getLogger("planner")
HISTORY = 240  # decisions kept for /decision


def build_planner(s: PlannerSettings, profile) -> Planner:
    cfg = PlanConfig(slo=s.slo, bounds={"prefill": s.prefill, "decode": s.decode}, max_utilization=s.max_utilization,
                     scale_up_cooldown_s=s.scale_up_cooldown_s, scale_down_cooldown_s=s.scale_down_cooldown_s)
    pred = LoadPredictor(smoothing=s.smoothing, trend_smoothing=s.trend_smoothing, margin_sigmas=s.margin_sigmas)
    return Planner(profile, cfg, predictor=pred, corrections=Corrections(enabled=s.correction))


def build_connector(s: PlannerSettings, r, clock=time.time, api=None):
    if s.mode == "off":
        return Publish()
    if s.mode == "local":
        return LocalFollow(r, s.pool)
    k = s.kubernetes
    if api is None:
        api = RecordingApi(k.record_file) if k.record_file else KubeApi()
    ns = default_namespace(k.namespace)
    lease = LeaseKeeper(api, ns, k.lease_name, default_identity(k.identity), k.lease_duration_s, clock)
    return KubeScale(api, ns, {"prefill": s.prefill.deployment, "decode": s.decode.deployment}, lease)


class PlannerService:
    def __init__(self, settings: PlannerSettings, redis, connector=None, clock=time.monotonic) -> None:
        self.s, self.r, self.clock = settings, redis, clock
        self.metrics = PlannerMetrics()
        self.signals = Signals(redis, KeySpace(settings.redis.shard_count()), settings.pool)
        self.connector = connector if connector is not None else build_connector(settings, redis)
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self.profile_error = ""
        try:
            self.profile = load_profile(settings.profile_path)
            self.planner = build_planner(settings, self.profile)
            log.info("capacity profile %s (model %s): prefill %d points, decode %d slots", self.profile.source,
                     self.profile.model, len(self.profile.prefill_points), self.profile.slots)
        except ProfileError as e:
            self.profile, self.planner, self.profile_error = None, None, f"capacity profile unusable: {e}"
            log.error("%s; holding the current replicas until it is fixed (restart after fixing)", e)
        self._last_hold = ""
        self.last: Decision | None = None

    async def tick(self) -> Decision:
        t = self.clock()
        try:
            return await self._tick(t)
        except (RedisError, OSError) as e:
            return self._held(t, None, None, f"Redis unreachable: {e}")

    async def _tick(self, t: float) -> Decision:
        leader = await self.connector.refresh_leader()
        self.metrics.leader.set(1 if leader else 0)
        try:
            snap = await self.signals.read(t)
        except NoSignal as e:
            return self._held(t, None, None, str(e))
        try:
            current = await self.connector.current(snap.live)
        except Exception as e:  # noqa: BLE001 - the API server: a scale read failed (any client error)
            return self._held(t, None, snap.observation, f"Kubernetes: replicas not read ({e})")
        if self.profile_error:
            return self._held(t, current, snap.observation, self.profile_error)
        if snap.observation is None:
            return self._held(t, current, None, "first interval: counting starts now")
        d = self.planner.step(snap.observation, current)
        if not leader and not d.held:
            d = dataclasses.replace(d, prefill=current["prefill"], decode=current["decode"],
                                    held="not the leader: another planner holds the lease")
        if d.held:
            return self._held(t, current, snap.observation, d.held, d)
        if any(d.replicas(r) != current[r] for r in ROLES):
            log.info("decision: prefill %d -> %d, decode %d -> %d (needed %d / %d; predicted %.2f req/s + %.2f margin, "
                     "%.0f prompt / %.0f output tokens)%s", current["prefill"], d.prefill, current["decode"], d.decode,
                     d.wanted_prefill, d.wanted_decode, d.forecast.rate, d.forecast.margin, d.forecast.prompt_tokens,
                     d.forecast.output_tokens, "".join(f"; {n}" for n in d.notes))
        try:
            await self.connector.apply(d, current)
        except Exception as e:  # noqa: BLE001 - any client error: held, and said why
            return self._held(t, current, snap.observation, f"Kubernetes: scale not written ({e})", d)
        self._last_hold = ""
        return self._done(d, current, snap.observation)

    def _held(self, t, current, obs, reason: str, d: Decision | None = None) -> Decision:
        if current is None and self.last is not None:
            current = {r: self.last.replicas(r) for r in ROLES}
        if reason != self._last_hold:
            log.warning("holding the current replicas (%s): %s", "unknown" if current is None else
                        f"prefill {current['prefill']}, decode {current['decode']}", reason)
            self._last_hold = reason
        if current is None:
            # Nothing known yet (Redis down from the start): no replica count is published at all
            # (/keda answers 503, the desired gauges stay unset), so nothing follows a made-up 0.
            self.metrics.held.set(1)
            self.metrics.holds.labels(hold_kind(reason)).inc()
            self.history.append({"t": round(t, 3), "wall_time": round(time.time(), 3), "current": None,
                                 "desired": None, "needed": None, "held": reason, "notes": []})
            return Decision(t, 0, 0, None, None, held=reason)
        held = Decision(t, current["prefill"], current["decode"], d.wanted_prefill if d else None,
                        d.wanted_decode if d else None, held=reason, notes=d.notes if d else (),
                        forecast=d.forecast if d else None, decode_batch=d.decode_batch if d else None)
        return self._done(held, current, obs)

    def _done(self, d: Decision, current: dict[str, int], obs) -> Decision:
        self.metrics.record(d, current, obs)
        self.last = d
        self.history.append(decision_json(d, current, obs))
        return d

    async def run(self, stop: asyncio.Event) -> None:
        log.info("planner for pool %r, mode %s, every %gs; SLO TTFT %g s, ITL %g s", self.s.pool, self.s.mode,
                 self.s.interval_s, self.s.slo.ttft_s, self.s.slo.itl_s)
        while not stop.is_set():
            await self.tick()
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.s.interval_s)
            except asyncio.TimeoutError:
                pass


def decision_json(d: Decision, current: dict[str, int], obs) -> dict:
    out = {"t": round(d.t, 3), "wall_time": round(time.time(), 3), "current": current,
           "desired": {"prefill": d.prefill, "decode": d.decode},
           "needed": {"prefill": d.wanted_prefill, "decode": d.wanted_decode}, "held": d.held, "notes": list(d.notes)}
    if d.corrections is not None:
        out["corrections"] = {"prefill": round(d.corrections[0], 3), "decode": round(d.corrections[1], 3)}
    if d.decode_batch is not None:
        b = d.decode_batch
        out["decode_batch"] = {"itl": b.itl, "kv": b.kv, "size": b.size, "kv_bound": b.kv_bound,
                               "positions": None if b.positions is None else round(b.positions, 1)}
    if d.forecast is not None:
        f = d.forecast
        out["forecast"] = {"rate": round(f.rate, 4), "margin": round(f.margin, 4),
                           "prompt_tokens": round(f.prompt_tokens, 1), "output_tokens": round(f.output_tokens, 1)}
    if obs is not None:
        out["observed"] = {"interval_s": round(obs.interval_s, 3), "arrivals": obs.arrivals,
                           "prompt_tokens_mean": obs.prompt_tokens_mean, "output_tokens_mean": obs.output_tokens_mean,
                           "prefill_arrivals": obs.prefill_arrivals, "prefilled_per_s": obs.prefilled_per_s,
                           "decoded_tokens_per_s": obs.decoded_tokens_per_s,
                           "prefill_seconds_seen": obs.prefill_seconds_seen,
                           "prefill_backlog": obs.prefill_backlog, "decode_backlog": obs.decode_backlog,
                           "ttft_mean_s": obs.ttft_mean_s, "itl_mean_s": obs.itl_mean_s,
                           "kv": None if obs.kv is None else dataclasses.asdict(obs.kv)}
    return out
