"""How many prefill and decode pods the next interval needs: pure functions of the measured
profile, the SLO targets and the predicted load, plus the bounds and cooldowns around them.

Prefill. A pod runs one prompt at a time, `s = profile.prefill_seconds(prompt_tokens)` each. Seen
as a queue, a pod kept at utilisation rho answers in about s / (1 - rho) (M/M/1, conservative for
pods that share one queue), so meeting the TTFT target T needs rho <= 1 - s / T (the prefill pod
publishes the first token itself: the hand-off to decode is in the first gap, not in TTFT);
never above `max_utilization` either. Replicas = ceil(load * s / rho), where load is the planned
arrival rate plus the backlog spread over one interval.

Decode. A pod's batch b is bounded twice: by the largest batch whose step time meets the ITL
target (never past the profile's slots: the step time is not extrapolated), and by the sequences
its KV holds at the predicted mean length (planner/kv.py; unknown when no decode pod's heartbeat
says, and then the ITL bound alone, as before). A running sequence holds prompt + output / 2 positions on average
over its life (it enters with its prompt and grows a position a step), which is also the context
length Dynamo's SLA planner sizes decode at; the pods' sum over their sequences is that mean times
the batch. The pod then makes max_utilization * b / itl(b) tokens/s. Replicas = ceil(load *
output_tokens / that), with the ready backlog counted like prefill's.

Both use the profile scaled by what the pods measurably do (planner/correct.py).

Lead time. A pod asked for now serves only after its cold start (the profile's `cold_start_s`:
weights loaded, steps compiled), so each role is sized for the larger of the next interval's
forecast and the forecast `1 + cold_start_s / interval` intervals ahead: on a rising load the
scale-up is asked for that far ahead; on a falling one the nearer forecast keeps what runs.

A target no replica count can meet (one prompt's prefill alone longer than the TTFT target, one
step alone longer than the ITL target) is infeasible: the planner says which and holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.correct import Corrections
from planner.kv import KVCapacity
from planner.predict import Forecast, LoadPredictor
from planner.profile import Profile
from planner.settings import RoleBounds, SLOConfig

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Observation:
    """One interval of the cluster, as the signals (planner/signals.py) or the simulator saw it."""

    t: float  # end of the interval, seconds on any monotonic clock
    interval_s: float
    arrivals: int  # requests admitted in the interval
    prompt_tokens_mean: float | None  # of the requests admitted (None: none)
    output_tokens_mean: float | None  # of the requests finished (None: none)
    prefill_backlog: int = 0  # admission entries not yet taken by a prefill pod
    decode_backlog: int = 0  # prefilled requests waiting for a decode slot
    ttft_mean_s: float | None = None  # measured, for the record and the gauges
    itl_mean_s: float | None = None
    # Of the arrivals, those prefilled on prefill pods (short prompts may be prefilled on decode
    # pods) and their mean prompt length; None = all of them, as `arrivals` and `prompt_tokens_mean`.
    prefill_arrivals: int | None = None
    prefill_prompt_tokens_mean: float | None = None
    # What the pods did (their heartbeats), for the record: the decision uses the profile.
    prefilled_per_s: float | None = None
    decoded_tokens_per_s: float | None = None
    prefill_seconds_seen: float | None = None  # the prefill pods' mean recent seconds a prompt
    # The decode pods' KV (their heartbeats; planner/kv.py): None = unknown, decode sized by ITL alone.
    kv: KVCapacity | None = None


@dataclass(frozen=True)
class DecodeBatch:
    """The batch one decode pod is planned at, and what bounds it."""

    itl: int  # the largest batch whose step meets the ITL target (<= the profile's slots)
    kv: int | None = None  # sequences the pod's KV holds at `positions` each (None: capacity unknown)
    positions: float | None = None  # positions a running sequence holds on average: prompt + output / 2

    @property
    def size(self) -> int:
        """The batch the replicas are sized at: the smaller bound."""
        return self.itl if self.kv is None else min(self.itl, self.kv)

    @property
    def kv_bound(self) -> bool:
        """The KV, not the ITL target, bounds the batch."""
        return self.kv is not None and self.kv < self.itl

    def note(self) -> str:
        """What the decision's notes say when the KV bounds the batch ("" when it does not)."""
        if not self.kv_bound:
            return ""
        return (f"decode: KV holds {self.kv} sequences of ~{self.positions:.0f} positions per pod, below the "
                f"{self.itl} the ITL target allows")


@dataclass(frozen=True)
class Decision:
    t: float
    prefill: int  # replicas to run now
    decode: int
    wanted_prefill: int | None  # what the load needs, before bounds and cooldowns (None: held)
    wanted_decode: int | None
    held: str = ""  # why the current replicas are kept ("" = a decision was made)
    notes: tuple[str, ...] = ()
    forecast: Forecast | None = None
    corrections: tuple[float, float] | None = None  # (prefill, decode) slowdowns of the profile used
    decode_batch: DecodeBatch | None = None  # the batch a decode pod was sized at, and its bounds

    def replicas(self, role: str) -> int:
        return self.prefill if role == "prefill" else self.decode


class Infeasible(ValueError):
    """The SLO targets cannot be met by any number of pods with this profile."""


def prefill_needed(rate: float, prompt_tokens: float, profile: Profile, slo: SLOConfig,
                   max_utilization: float, slowdown: float = 1.0) -> int:
    """`slowdown`: the measured correction of the profile (planner/correct.py)."""
    s = profile.prefill_seconds(prompt_tokens) * slowdown
    # the prefill pod publishes the first token itself: the hand-off to decode is not in TTFT
    if s >= slo.ttft_s:
        raise Infeasible(f"one {prompt_tokens:.0f}-token prefill takes {s * 1000:.0f} ms (the profile's x "
                         f"{slowdown:.2f} measured), at or past the TTFT target {slo.ttft_s * 1000:.0f} ms")
    rho = min(max_utilization, 1.0 - s / slo.ttft_s)
    return math.ceil(rate * s / rho - 1e-9)


def decode_batch(profile: Profile, slo: SLOConfig, slowdown: float = 1.0, kv: KVCapacity | None = None,
                 prompt_tokens: float = 0.0, output_tokens: float = 0.0) -> DecodeBatch:
    """The batch one decode pod may run: the ITL target's, capped by what `kv` holds at a running
    sequence's mean length, prompt + output / 2 (`kv` None: the ITL target's alone). The KV bound
    only ever lowers the batch: past the profile's slots there is no step time to size with."""
    b = profile.decode_batch_for_itl(slo.itl_s / slowdown)
    if b == 0:
        raise Infeasible(f"one request alone steps every {profile.decode_itl(1) * slowdown * 1000:.1f} ms (the "
                         f"profile's x {slowdown:.2f} measured), past the ITL target {slo.itl_s * 1000:.1f} ms")
    if kv is None:
        return DecodeBatch(itl=b)
    positions = max(0.0, prompt_tokens) + max(0.0, output_tokens) / 2
    return DecodeBatch(itl=b, kv=kv.sequences(positions), positions=positions)


def decode_replicas(rate: float, output_tokens: float, batch: DecodeBatch, profile: Profile,
                    max_utilization: float, slowdown: float = 1.0) -> int:
    """Decode pods for `rate` requests/s of `output_tokens` each, every pod running `batch.size`."""
    b = batch.size
    per_pod = max_utilization * b / (profile.decode_itl(b) * slowdown)  # tokens/s
    return math.ceil(rate * output_tokens / per_pod - 1e-9)


def decode_needed(rate: float, output_tokens: float, profile: Profile, slo: SLOConfig,
                  max_utilization: float, slowdown: float = 1.0, kv: KVCapacity | None = None,
                  prompt_tokens: float = 0.0) -> int:
    """Decode pods for a load: `decode_replicas` at `decode_batch` (`kv` None: by ITL alone)."""
    batch = decode_batch(profile, slo, slowdown, kv, prompt_tokens, output_tokens)
    return decode_replicas(rate, output_tokens, batch, profile, max_utilization, slowdown)


@dataclass
class PlanConfig:
    slo: SLOConfig
    bounds: dict[str, RoleBounds]
    max_utilization: float = 0.8
    scale_up_cooldown_s: float = 60.0
    scale_down_cooldown_s: float = 300.0


@dataclass
class Planner:
    """Turns observations into decisions. Holds the predictor, each role's recent wants (the
    scale-down window) and when each role last changed; nothing else."""

    profile: Profile
    cfg: PlanConfig
    predictor: LoadPredictor = field(default_factory=LoadPredictor)  # all arrivals: sizes decode
    corrections: Corrections = field(default_factory=Corrections)
    remote: LoadPredictor | None = None  # arrivals prefilled on prefill pods: sizes prefill
    started_at: float | None = None
    last_up: dict[str, float] = field(default_factory=dict)
    wants: dict[str, list[tuple[float, int]]] = field(default_factory=lambda: {r: [] for r in ROLES})

    def __post_init__(self) -> None:
        if self.remote is None:
            p = self.predictor
            self.remote = LoadPredictor(p.smoothing, p.trend_smoothing, p.margin_sigmas, p.window)

    def hold(self, t: float, current: dict[str, int], reason: str, forecast: Forecast | None = None) -> Decision:
        return Decision(t, current["prefill"], current["decode"], None, None, held=reason, forecast=forecast)

    def step(self, obs: Observation, current: dict[str, int]) -> Decision:
        """The replicas for the next interval, given this one's observation and what runs now."""
        if self.started_at is None:
            self.started_at = obs.t - obs.interval_s
        self.predictor.observe(obs.arrivals / obs.interval_s, obs.prompt_tokens_mean, obs.output_tokens_mean)
        remote = obs.arrivals if obs.prefill_arrivals is None else obs.prefill_arrivals
        self.remote.observe(remote / obs.interval_s, obs.prefill_prompt_tokens_mean or obs.prompt_tokens_mean,
                            obs.output_tokens_mean)
        if not self.predictor.ready:
            return self.hold(obs.t, current, "warming up: no finished request seen yet")
        self.corrections.observe(obs, self.profile, current["decode"])
        fc, fr = self.predictor.forecast(), self.remote.forecast()
        lead = self.profile.cold_start_s / obs.interval_s  # intervals a pod started now takes to serve
        if lead > 0 and self.remote is not None:  # size for the load when a pod started now serves, when higher
            fc = max(fc, self.predictor.forecast(1 + lead), key=lambda f: f.planned_rate)
            fr = max(fr, self.remote.forecast(1 + lead), key=lambda f: f.planned_rate)
        load_p = fr.planned_rate + obs.prefill_backlog / obs.interval_s
        load_d = fc.planned_rate + obs.decode_backlog / obs.interval_s
        u, c = self.cfg.max_utilization, self.corrections
        try:
            prefill = prefill_needed(load_p, fr.prompt_tokens, self.profile, self.cfg.slo, u, c.prefill)
            batch = decode_batch(self.profile, self.cfg.slo, c.decode, obs.kv, fc.prompt_tokens, fc.output_tokens)
            wanted = {"prefill": prefill,
                      "decode": decode_replicas(load_d, fc.output_tokens, batch, self.profile, u, c.decode)}
        except Infeasible as e:
            return self.hold(obs.t, current, f"SLO infeasible: {e}", fc)
        notes, out = [], {}
        if batch.kv_bound:
            notes.append(batch.note())
        for role in ROLES:
            out[role], note = self._bounded(role, wanted[role], current[role], obs.t)
            if note:
                notes.append(note)
        return Decision(obs.t, out["prefill"], out["decode"], wanted["prefill"], wanted["decode"],
                        notes=tuple(notes), forecast=fc, corrections=(c.prefill, c.decode), decode_batch=batch)

    def _bounded(self, role: str, wanted: int, current: int, t: float) -> tuple[int, str]:
        b, cfg = self.cfg.bounds[role], self.cfg
        note = ""
        floor = b.min_replicas if b.allow_zero else max(1, b.min_replicas)
        target = min(max(wanted, floor), b.max_replicas)
        if wanted > b.max_replicas:
            note = f"{role}: the load needs {wanted} pods, capped at max_replicas {b.max_replicas} (SLO at risk)"
        window = self.wants[role]
        window.append((t, target))
        while window and window[0][0] < t - cfg.scale_down_cooldown_s:
            window.pop(0)
        if target > current:
            since = t - self.last_up.get(role, -math.inf)
            if since < cfg.scale_up_cooldown_s:
                return current, note or f"{role}: up to {target} waits for the scale-up cooldown ({since:.0f}/{cfg.scale_up_cooldown_s:.0f} s)"
            self.last_up[role] = t
            return target, note
        if target < current:
            if t - self.started_at < cfg.scale_down_cooldown_s:
                return current, note or f"{role}: no scale-down in the first {cfg.scale_down_cooldown_s:.0f} s"
            # the most wanted over the window: a dip shorter than it does not scale down
            return max(min(current, max(w for _, w in window)), floor), note
        return current, note
