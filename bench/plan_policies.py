"""The replica policies bench/plan_sim.py compares, each behind one shape: `name`, `period_s` (how
often it is asked; 0 = never), `initial()` (the replicas a run starts with, ready at t=0) and
`decide(t, snapshot) -> {role: replicas} | None`.

  * StaticPolicy: fixed replicas. `size_for` gives the count a load needs by the planner's own
    arithmetic (planner.decide.prefill_needed / decode_needed at the load's mean rate and lengths),
    so "static, sized for the mean" differs from the planner only in not moving.
  * HPAPolicy: one Kubernetes HorizontalPodAutoscaler per role (autoscaling/v2, its defaults) on a
    queue-length metric, every `sync_s` (the controller's --horizontal-pod-autoscaler-sync-period,
    15 s). desired = ceil(current * metric / target) with metric the per-pod average, skipped
    within the 10% tolerance; scale-down stabilization: the highest recommendation of the last
    300 s; scale-up rate: at most max(double, +4 pods) per sync. Metrics: prefill = prompts waiting
    + in prefill, per pod; decode = requests waiting for a slot + in slots, per pod (what a
    Prometheus adapter would serve from the admission / ready backlogs and the running gauges).
  * PlannerPolicy: planner.decide.Planner, fed an Observation every `interval_s` built from what
    the simulated cluster saw in the interval (arrivals, lengths, backlogs, the mean TTFT and gap,
    and what the pods did: prompts prefilled and their mean busy seconds, tokens decoded, which
    the planner's correction factors read, and the decode pods' KV capacity when the model has
    one: `kv_signal=False` withholds it, the planner as it was before it read KV); its decisions are
    kept in `log`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from bench.plan_model import ROLES, Snapshot
from planner.correct import Corrections
from planner.decide import Observation, PlanConfig, Planner, decode_needed, prefill_needed
from planner.kv import KVCapacity
from planner.predict import LoadPredictor
from planner.profile import Profile
from planner.settings import RoleBounds, SLOConfig


def scaled(profile: Profile, prefill_mult: float = 1.0, prefill_add_s: float = 0.0, decode_mult: float = 1.0) -> Profile:
    """The profile with every prefill point a * s + c and every decode step k * itl (a cluster
    whose pods cost more, or less, than the profile says)."""
    return dataclasses.replace(
        profile, prefill_points=tuple((t, v * prefill_mult + prefill_add_s) for t, v in profile.prefill_points),
        decode_points=tuple((b, v * decode_mult) for b, v in profile.decode_points))


def size_for(rate: float, prompt_mean: float, output_mean: float, profile: Profile, slo: SLOConfig,
             max_utilization: float = 0.8, kv: KVCapacity | None = None) -> dict[str, int]:
    """Replicas per role for a steady load (req/s, mean lengths), by the planner's arithmetic
    (`kv`: the decode pods' KV bounds their batch too; None: the ITL target alone)."""
    return {"prefill": max(1, prefill_needed(rate, prompt_mean, profile, slo, max_utilization)),
            "decode": max(1, decode_needed(rate, output_mean, profile, slo, max_utilization, kv=kv,
                                           prompt_tokens=prompt_mean))}


@dataclass
class StaticPolicy:
    replicas: dict[str, int]
    name: str = "static"
    period_s: float = 0.0
    log: list = field(default_factory=list)

    def initial(self) -> dict[str, int]:
        return dict(self.replicas)

    def decide(self, t: float, snap: Snapshot) -> None:
        return None


# ---------------------------------------------------------------------------------------------
# Kubernetes' HPA


def hpa_desired(current: int, metric_per_pod: float, target: float, tolerance: float = 0.1) -> int:
    """The HPA's replica calculation: ceil(current * metric / target), or `current` when the
    ratio is within the tolerance of 1. With no pod running the metric cannot be averaged:
    one pod when there is any load, else none."""
    if current <= 0:
        return 1 if metric_per_pod > 0 else 0
    ratio = metric_per_pod / target
    if abs(ratio - 1.0) <= tolerance:
        return current
    return math.ceil(current * ratio - 1e-9)


@dataclass
class HPAStabilizer:
    """autoscaling/v2 behaviour with its defaults: scale-down stabilization window (the highest
    recommendation over it wins), no scale-up stabilization, and the scale-up rate limit (the
    larger of +100% and +4 pods per period). Scale-down may go all the way in one step (100%)."""

    down_window_s: float = 300.0
    up_percent: float = 100.0
    up_pods: int = 4
    recs: list = field(default_factory=list)  # (t, recommendation)

    def recommend(self, t: float, desired: int, current: int) -> int:
        self.recs.append((t, desired))
        self.recs = [(ts, r) for ts, r in self.recs if ts > t - self.down_window_s]
        down = max(r for _, r in self.recs)
        out = current
        if out < desired:
            out = desired  # up: the window is 0 s, so the newest recommendation alone
        if out > down:
            out = down
        if out > current:
            limit = max(math.ceil(current * (1 + self.up_percent / 100.0)), current + self.up_pods)
            out = min(out, limit)
        return out


@dataclass
class HPAPolicy:
    targets: dict[str, float]  # per-pod metric target per role
    bounds: dict[str, RoleBounds]
    start: dict[str, int]
    sync_s: float = 15.0
    tolerance: float = 0.1
    down_window_s: float = 300.0
    name: str = "hpa"
    log: list = field(default_factory=list)
    stab: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # as if the HPA had been running at the start's replicas: no scale-down in the first window
        self.stab = {r: HPAStabilizer(self.down_window_s, recs=[(0.0, self.start[r])]) for r in ROLES}

    @property
    def period_s(self) -> float:
        return self.sync_s

    def initial(self) -> dict[str, int]:
        return dict(self.start)

    @staticmethod
    def metric_total(role: str, snap: Snapshot) -> float:
        return snap.admission + snap.prefilling if role == "prefill" else snap.ready + snap.decoding

    def decide(self, t: float, snap: Snapshot) -> dict[str, int]:
        out = {}
        for role in ROLES:
            cur = snap.current[role]
            per_pod = self.metric_total(role, snap) / max(1, cur)
            want = hpa_desired(cur, per_pod, self.targets[role], self.tolerance)
            rec = self.stab[role].recommend(t, want, cur)
            b = self.bounds[role]
            out[role] = min(max(rec, b.min_replicas if b.allow_zero else max(1, b.min_replicas)), b.max_replicas)
        self.log.append((t, out["prefill"], out["decode"]))
        return out


# ---------------------------------------------------------------------------------------------
# the planner


@dataclass
class PlannerPolicy:
    profile: Profile
    cfg: PlanConfig
    start: dict[str, int]
    interval_s: float = 30.0
    predictor: LoadPredictor | None = None
    correction: bool = True  # the planner's correction factors (planner/correct.py), as its setting
    kv_signal: bool = True  # the observation carries the decode pods' KV capacity (when the model has one)
    name: str = "planner"
    log: list = field(default_factory=list)  # (t, decision)
    planner: Planner | None = None

    def __post_init__(self) -> None:
        self.planner = Planner(self.profile, self.cfg, predictor=self.predictor or LoadPredictor(),
                               corrections=Corrections(enabled=self.correction))

    @property
    def period_s(self) -> float:
        return self.interval_s

    def initial(self) -> dict[str, int]:
        return dict(self.start)

    def observation(self, snap: Snapshot) -> Observation:
        return Observation(
            t=snap.t, interval_s=snap.interval_s, arrivals=snap.arrivals,
            prompt_tokens_mean=snap.prompt_sum / snap.arrivals if snap.arrivals else None,
            output_tokens_mean=snap.output_sum / snap.finished if snap.finished else None,
            prefill_backlog=snap.admission, decode_backlog=snap.ready,
            ttft_mean_s=snap.ttft_sum / snap.ttft_n if snap.ttft_n else None,
            itl_mean_s=snap.gap_sum / snap.gap_n if snap.gap_n else None,
            prefilled_per_s=snap.prefilled / snap.interval_s,
            decoded_tokens_per_s=snap.decoded / snap.interval_s,
            prefill_seconds_seen=snap.prefill_busy_s / snap.prefilled if snap.prefilled else None,
            kv=snap.kv if self.kv_signal else None)

    def decide(self, t: float, snap: Snapshot) -> dict[str, int]:
        d = self.planner.step(self.observation(snap), dict(snap.current))
        self.log.append((t, d))
        return {"prefill": d.prefill, "decode": d.decode}
