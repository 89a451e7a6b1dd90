"""The planner's Prometheus metrics (a registry of its own, like the gateway's)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from planner.decide import ROLES, Decision, Observation
from planner.kv import KVCapacity


class PlannerMetrics:
    def __init__(self) -> None:
        reg = self.registry = CollectorRegistry(auto_describe=True)
        self.desired = Gauge("tandem_planner_desired_replicas", "Replicas the planner wants now (after bounds "
                             "and cooldowns; KEDA's metrics-api trigger can follow it)", ["role"], registry=reg)
        self.wanted = Gauge("tandem_planner_needed_replicas", "Replicas the predicted load needs, before bounds "
                            "and cooldowns (NaN while holding)", ["role"], registry=reg)
        self.current = Gauge("tandem_planner_current_replicas", "Replicas running (or last set)", ["role"],
                             registry=reg)
        self.rate = Gauge("tandem_planner_predicted_rate", "Requests/s predicted for the next interval", registry=reg)
        self.margin = Gauge("tandem_planner_predicted_margin", "Requests/s added to the prediction for safety",
                            registry=reg)
        self.lengths = Gauge("tandem_planner_predicted_tokens", "Mean tokens per request predicted",
                             ["kind"], registry=reg)
        self.observed = Gauge("tandem_planner_observed", "Last interval as measured (arrival rate req/s, "
                              "TTFT and ITL seconds, backlogs, pods' prompts/s and tokens/s, seconds a prompt)", ["signal"], registry=reg)
        self.held = Gauge("tandem_planner_holding", "1 while the planner keeps the replicas as they are "
                          "(bad profile, no signals, infeasible SLO, not the leader)", registry=reg)
        self.holds = Counter("tandem_planner_holds", "Intervals held, by why", ["reason"], registry=reg)
        self.decisions = Counter("tandem_planner_decisions", "Intervals decided", registry=reg)
        self.scale_events = Counter("tandem_planner_scale_events", "Replica changes decided",
                                    ["role", "direction"], registry=reg)
        self.correction = Gauge("tandem_planner_profile_correction", "How much slower the pods measurably are "
                                "than the capacity profile (planner/correct.py; 1 = as profiled)", ["role"],
                                registry=reg)
        self.decode_batch = Gauge("tandem_planner_decode_batch", "Sequences one decode pod is sized to run: "
                                  "itl = the most whose step meets the ITL target, kv = the most its KV holds at the "
                                  "predicted mean length (NaN: capacity unknown), planned = the smaller",
                                  ["bound"], registry=reg)
        self.kv = Gauge("tandem_planner_decode_kv", "The decode pods' KV as their heartbeats say (the smallest "
                        "pod's): rows, block_size, blocks_total, reserve_blocks (0 on the slot layout), paged (1/0), "
                        "used (the pods' mean share of KV in use), pods", ["field"], registry=reg)
        self.leader = Gauge("tandem_planner_leader", "1 when this planner may scale (holds the Lease)",
                            registry=reg)

    def record(self, d: Decision, current: dict[str, int], obs: Observation | None) -> None:
        for r in ROLES:
            self.desired.labels(r).set(d.replicas(r))
            self.current.labels(r).set(current[r])
            w = d.wanted_prefill if r == "prefill" else d.wanted_decode
            self.wanted.labels(r).set(float("nan") if w is None else w)
            if d.replicas(r) != current[r] and not d.held:
                self.scale_events.labels(r, "up" if d.replicas(r) > current[r] else "down").inc()
        self.held.set(1 if d.held else 0)
        if d.held:
            self.holds.labels(hold_kind(d.held)).inc()
        else:
            self.decisions.inc()
        if d.corrections is not None:
            self.correction.labels("prefill").set(d.corrections[0])
            self.correction.labels("decode").set(d.corrections[1])
        b, nan = d.decode_batch, float("nan")  # None (a hold before sizing): NaN, as the needed replicas
        self.decode_batch.labels("itl").set(nan if b is None else b.itl)
        self.decode_batch.labels("kv").set(nan if b is None or b.kv is None else b.kv)
        self.decode_batch.labels("planned").set(nan if b is None else b.size)
        if d.forecast is not None:
            self.rate.set(d.forecast.rate)
            self.margin.set(d.forecast.margin)
            self.lengths.labels("prompt").set(d.forecast.prompt_tokens)
            self.lengths.labels("output").set(d.forecast.output_tokens)
        if obs is not None:
            self.observed.labels("arrival_rate").set(obs.arrivals / obs.interval_s)
            self.observed.labels("prefill_backlog").set(obs.prefill_backlog)
            self.observed.labels("decode_backlog").set(obs.decode_backlog)
            for name, v in (("ttft_s", obs.ttft_mean_s), ("itl_s", obs.itl_mean_s),
                            ("prefilled_per_s", obs.prefilled_per_s), ("decoded_tokens_per_s", obs.decoded_tokens_per_s),
                            ("prefill_seconds_seen", obs.prefill_seconds_seen)):
                if v is not None:
                    self.observed.labels(name).set(v)
            self.record_kv(obs.kv)

    def record_kv(self, k: KVCapacity | None) -> None:
        """The decode pods' KV gauges; NaN (pods 0) while no decode pod says (nothing stale)."""
        nan = float("nan")
        fields: tuple[tuple[str, float], ...] = (
            ("rows", nan), ("block_size", nan), ("blocks_total", nan), ("reserve_blocks", nan), ("paged", nan),
            ("used", nan), ("pods", 0)) if k is None else (
            ("rows", k.rows), ("block_size", k.block_size), ("blocks_total", k.blocks_total),
            ("reserve_blocks", k.reserve_blocks), ("paged", 1 if k.layout == "paged" else 0),
            ("used", nan if k.used is None else k.used), ("pods", k.pods))
        for name, v in fields:
            self.kv.labels(name).set(v)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def hold_kind(reason: str) -> str:
    """A short label for a hold reason (the reason text itself goes to the log and /decision)."""
    for prefix, kind in (("capacity profile", "profile"), ("SLO infeasible", "infeasible"),
                         ("Redis", "redis"), ("no gateway", "no_signal"), ("warming up", "warming_up"),
                         ("first interval", "warming_up"), ("not the leader", "not_leader"),
                         ("Kubernetes", "kubernetes")):
        if reason.startswith(prefix):
            return kind
    return "other"
