"""The gateway's Prometheus metrics, on a registry of its own (one per app, so tests can build
several apps in one process and `/metrics` shows only what the gateway measures).

Latencies are measured where the client sees them: at the gateway, per relayed token.
`tandem_queue_seconds` is taken on the Redis clock (admission entry id -> first token entry id),
so gateway/worker clock skew does not enter it; it covers queueing plus prefill because the
gateway cannot see when a prefill pod claims the entry.

The `vllm:*` gauges are the names the Kubernetes Gateway API Inference Extension's endpoint picker
reads by default (its model-server protocol, docs/proposals/003-model-server-protocol, and the
EPP flags --total-queued-requests-metric, --total-running-requests-metric,
--kv-cache-usage-percentage-metric, --lora-info-metric). They describe the whole cluster behind
this gateway, computed from the Redis registry at scrape time (`cluster_load`), so every replica
reports the same numbers; see docs/api.md.

The prefix-cache counters (`vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`, in
prompt tokens, as vLLM counts them, and `tandem_prefill_tokens_computed_total`) are cluster-wide
too: each pod heartbeats its cumulative counts and `PodCounters` turns them into increments.
Like the gauges, every replica reports the whole cluster: aggregate replicas with max, not sum.
"""
from __future__ import annotations

import time
from collections import OrderedDict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tandem_core.load_report import Increments

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST
_FINISHED = ("stop", "length", "tool_calls")  # outcomes of tandem_requests that ran to their end


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.waiting_for_redis = Gauge(
            "tandem_requests_waiting_for_redis", "New requests waiting for an unreachable Redis (gateway/hold.py)",
            registry=reg,
        )
        self.ttft = Histogram(
            "tandem_ttft_seconds", "Request arrival to first token relayed", buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "tandem_itl_seconds", "Time between consecutive relayed tokens", buckets=_ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "tandem_e2e_seconds", "Request arrival to last token relayed", buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.queue = Histogram(
            "tandem_queue_seconds", "Admission XADD to first token XADD (Redis clock)",
            buckets=_LATENCY_BUCKETS, registry=reg,
        )
        self.requests = Counter(
            "tandem_requests", "Finished requests by outcome (finish reason or error kind)",
            ["outcome"], registry=reg,
        )
        self.running = Gauge("tandem_requests_running", "Requests being relayed now", registry=reg)
        # what the planner sizes the cluster from (gateway/load_publisher.py publishes them to Redis)
        self.admitted = Counter("tandem_requests_admitted", "Requests enqueued, by where they are prefilled "
                                "(remote: a prefill pod; local: a decode pod)", ["route"], registry=reg)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of the requests admitted, by route",
                                     ["route"], registry=reg)
        self.generation_tokens = Counter(
            "tandem_generation_tokens", "Output tokens relayed, counted when a request ends", registry=reg,
        )
        self.backlog = Gauge(
            "tandem_admission_backlog", "Admission entries not yet acked (last seen)", registry=reg
        )
        self.duplicates = Counter(
            "tandem_duplicate_tokens", "Token entries dropped because their index was already relayed",
            registry=reg,
        )

        self.routes = Counter(
            "tandem_route", "Where prompts were prefilled (conditional disaggregation), and why",
            ["route", "reason"], registry=reg,
        )
        self.predicted_ttft = Gauge(
            "tandem_predicted_ttft_seconds", "Predicted time to first token for a request admitted now",
            registry=reg,
        )
        self.prefix_routes = Counter(
            "tandem_prefix_route", "Remote prompts by cache-aware routing decision (gateway/prefix_route.py)",
            ["reason"], registry=reg,
        )
        self.decode_routes = Counter(
            "tandem_decode_route", "Remote prompts by cache-aware decode routing decision (gateway/decode_route.py)",
            ["reason"], registry=reg,
        )
        self._add_inference_extension_gauges(reg)
        self._add_prefix_cache_counters(reg)

    def _add_prefix_cache_counters(self, reg: CollectorRegistry) -> None:
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the pods' prefix caches (cluster)",
            registry=reg,
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the pods' prefix caches (cluster)", registry=reg,
        )
        self.prefill_computed = Counter(
            "tandem_prefill_tokens_computed", "Prompt tokens the pods actually prefilled (cluster)",
            registry=reg,
        )
        self._pod_counters = PodCounters()
        # speculative decoding (decode_svc/speculate.py), as vLLM names its counters
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Proposals checked by the decode pods (cluster)",
                                   registry=reg)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens",
                                         "Tokens proposed and checked by the decode pods (cluster)", registry=reg)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens",
                                     "Proposed tokens the target model kept (cluster)", registry=reg)
        self._spec_counters = PodCounters(SPEC_FIELDS, "speculative")
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Proposals whose token at this position (0-based) was kept (cluster)",
                                             ["position"], registry=reg)
        self._spec_pos_counters = PodCounters(SPEC_POSITIONS, "spec_pos")

    def observe_prefix_cache(self, workers: list[dict]) -> None:
        """Advance the prefix-cache counters (and the speculative-decoding ones) by what each pod's
        heartbeat added since the last look."""
        d = self._pod_counters.deltas(workers)
        self.prefix_queries.inc(d["queries"])
        self.prefix_hits.inc(d["hits"])
        self.prefill_computed.inc(d["computed"])
        d = self._spec_counters.deltas(workers)
        self.spec_drafts.inc(d["drafts"])
        self.spec_draft_tokens.inc(d["draft_tokens"])
        self.spec_accepted.inc(d["accepted_tokens"])
        per_pos = [{"id": w.get("id"), "pid": w.get("pid"), "extra": {"spec_pos": spec.get("accepted_per_pos") or {}}}
                   for w in workers if (spec := section_of(w, "speculative")) is not None]
        for pos, n in self._spec_pos_counters.deltas(per_pos).items():
            if n:
                self.spec_accepted_per_pos.labels(pos).inc(n)

    def _add_inference_extension_gauges(self, reg: CollectorRegistry) -> None:
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Requests queued: admission backlog (shared, per-pod and direct streams) + ready queue",
            ["model_name"], registry=reg,
        )
        self.running_cluster = Gauge(
            "vllm:num_requests_running", "Requests being decoded: decode slots in use", ["model_name"],
            registry=reg,
        )
        kv_doc = "KV in use, 0..1: max(decode slots used / slots, prefill held KV / KV budget)"
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", kv_doc, ["model_name"], registry=reg)
        self.kv_usage_legacy = Gauge(  # the name older EPP releases read
            "vllm:gpu_cache_usage_perc", kv_doc + " (legacy name)", ["model_name"], registry=reg,
        )
        self.lora_info = Gauge(  # no LoRA adapters: empty lists, max_lora 0; value = last update time
            "vllm:lora_requests_info", "LoRA adapters (none are served); value = update timestamp",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=reg,
        )

    def set_load(self, model: str, waiting: int, running: int, kv_usage: float) -> None:
        self.waiting.labels(model).set(waiting)
        self.running_cluster.labels(model).set(running)
        self.kv_usage.labels(model).set(kv_usage)
        self.kv_usage_legacy.labels(model).set(kv_usage)
        self.lora_info.labels("0", "", "").set(time.time())

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_admitted(self, route: str, prompt_tokens: int) -> None:
        self.admitted.labels(route).inc()
        self.prompt_tokens.labels(route).inc(prompt_tokens)

    def load_counts(self) -> dict[str, float]:
        """The cumulative counts tandem_core/load_report.py publishes for the planner."""
        def value(name: str) -> float:
            return float(self.registry.get_sample_value(name) or 0.0)

        finished = sum(float(s.value) for m in self.requests.collect() for s in m.samples
                       if s.name == "tandem_requests_total" and s.labels.get("outcome") in _FINISHED)
        adm = {r: float(self.registry.get_sample_value("tandem_requests_admitted_total", {"route": r}) or 0.0)
               for r in ("remote", "local")}
        tok = {r: float(self.registry.get_sample_value("tandem_prompt_tokens_total", {"route": r}) or 0.0)
               for r in ("remote", "local")}
        return {"admitted": adm["remote"] + adm["local"], "prompt_tokens": tok["remote"] + tok["local"],
                "admitted_remote": adm["remote"], "prompt_tokens_remote": tok["remote"], "finished": finished,
                "output_tokens": value("tandem_generation_tokens_total"),
                "ttft_sum": value("tandem_ttft_seconds_sum"), "ttft_count": value("tandem_ttft_seconds_count"),
                "itl_sum": value("tandem_itl_seconds_sum"), "itl_count": value("tandem_itl_seconds_count")}


SPEC_FIELDS = ("drafts", "draft_tokens", "accepted_tokens")
SPEC_POSITIONS = tuple(str(i) for i in range(16))  # accepted tokens by position: k up to 16


class PodCounters:
    """Increments of the pods' cumulative prefix-cache counts (or another heartbeat section's:
    `fields` of `extra[section]`) between two registry reads
    (tandem_core/load_report.Increments: a count going down, or a new pid, means the pod restarted
    and its whole count is new). A pod seen for the first time contributes its whole count. At
    most `max_pods` worker ids are remembered (least recently seen forgotten), so pod churn cannot
    grow it without bound.
    """

    FIELDS = ("queries", "hits", "computed")

    def __init__(self, fields: tuple[str, ...] = FIELDS, section: str = "prefix_cache", max_pods: int = 4096) -> None:
        self.fields, self.section = tuple(fields), section
        self._inc = Increments(self.fields, max_ids=max_pods, count_new=True)

    @property
    def _last(self) -> OrderedDict:
        return self._inc._last

    def deltas(self, workers: list[dict]) -> dict[str, int]:
        reports = [{"id": w["id"], "pid": w.get("pid"), **{f: pc.get(f) for f in self.fields}}
                   for w in workers if (pc := section_of(w, self.section)) is not None and w.get("id") is not None]
        got = self._inc.step(reports)
        return {f: int(got[f]) for f in self.fields}


def prefix_cache_of(worker: dict) -> dict | None:
    """The pod's heartbeat `extra["prefix_cache"]`, or None when it publishes none."""
    return section_of(worker, "prefix_cache")


def section_of(worker: dict, section: str) -> dict | None:
    """The pod's heartbeat `extra[section]`, or None when it publishes none."""
    got = (worker.get("extra") or {}).get(section)
    return got if isinstance(got, dict) else None


def prefix_cache_summary(workers: list[dict], gateway_block_size: int) -> dict:
    """`/admin/cluster`'s prefix_cache section: per pod its cache size and hit rate, and totals.
    `block_size_mismatch` lists pods whose block size is not the gateway's prefix_block_size
    (their caches still work; routing to them is then a worse guess)."""
    rows, tot = [], dict.fromkeys(("queries", "hits", "computed", "bytes", "blocks", "evicted"), 0)
    for w in workers:
        pc = prefix_cache_of(w)
        if pc is None:
            continue
        row = {"id": w.get("id"), "role": w.get("role"), "enabled": bool(pc.get("enabled")),
               "block_size": pc.get("block_size"), "budget_bytes": int(pc.get("budget_bytes") or 0)}
        for k in tot:
            row[k] = int(pc.get(k) or 0)
            tot[k] += row[k]
        row["hit_rate"] = _rate(row["hits"], row["queries"])
        rows.append(row)
    mismatch = [r["id"] for r in rows if r["enabled"] and r["block_size"] not in (None, gateway_block_size)]
    return {"workers": rows, "totals": {**tot, "hit_rate": _rate(tot["hits"], tot["queries"])},
            "gateway_block_size": gateway_block_size, "block_size_mismatch": mismatch}


def _rate(hits: int, queries: int) -> float | None:
    return round(hits / queries, 4) if queries else None


def cluster_load(workers: list[dict], admission_backlog: int, ready: int) -> tuple[int, int, float]:
    """(waiting, running, kv_usage) of the cluster, from the worker registry and the queue lengths.

    waiting: admission entries not yet prefilled (all priorities and the direct stream) plus
    prefilled requests waiting in the ready stream for a decode slot. running: decode slots in
    use. kv_usage: the fullest KV pool, because any one full stops new work: decode slots (slots
    used / slots) on pods with the slot layout, KV blocks (blocks used / blocks) on pods whose KV is
    paged (their heartbeat's `extra.kv`: there a row holds only the blocks its sequence wrote, so
    rows in use say little of the memory), and prefill KV held for pulls (held bytes / budget).
    """
    live = [w for w in workers if not w.get("draining")]
    dec = [w for w in live if w.get("role") == "decode"]
    pre = [w for w in live if w.get("role") == "prefill"]
    used = sum(max(0, int(w.get("slots", 0)) - int(w.get("free_slots", 0))) for w in dec)
    kv = [(w.get("extra") or {}).get("kv") or {} for w in dec]
    paged = [k for k in kv if k.get("blocks_total")]
    slotted = [w for w, k in zip(dec, kv) if not k.get("blocks_total")]
    slots = sum(int(w.get("slots", 0)) for w in slotted)
    slots_used = sum(max(0, int(w.get("slots", 0)) - int(w.get("free_slots", 0))) for w in slotted)
    blocks = sum(int(k["blocks_total"]) for k in paged)
    blocks_used = sum(int(k["blocks_total"]) - int(k.get("blocks_free", 0)) for k in paged)
    held = sum(int(w.get("held_kv_bytes", 0)) for w in pre)
    budget = sum(int((w.get("extra") or {}).get("kv_budget_bytes") or 0) for w in pre)
    usage = max(slots_used / slots if slots else 0.0, blocks_used / blocks if blocks else 0.0,
                held / budget if budget else 0.0)
    return admission_backlog + ready, used, min(1.0, usage)
