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
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
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
        self._add_inference_extension_gauges(reg)

    def _add_inference_extension_gauges(self, reg: CollectorRegistry) -> None:
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests queued: admission backlog (incl. direct) + ready queue",
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


def cluster_load(workers: list[dict], admission_backlog: int, ready: int) -> tuple[int, int, float]:
    """(waiting, running, kv_usage) of the cluster, from the worker registry and the queue lengths.

    waiting: admission entries not yet prefilled (all priorities and the direct stream) plus
    prefilled requests waiting in the ready stream for a decode slot. running: decode slots in
    use. kv_usage: the fuller of the two KV pools, decode slots (slots used / slots) and prefill
    KV held for pulls (held bytes / budget), because either one full stops new work.
    """
    live = [w for w in workers if not w.get("draining")]
    dec = [w for w in live if w.get("role") == "decode"]
    pre = [w for w in live if w.get("role") == "prefill"]
    slots = sum(int(w.get("slots", 0)) for w in dec)
    used = sum(max(0, int(w.get("slots", 0)) - int(w.get("free_slots", 0))) for w in dec)
    held = sum(int(w.get("held_kv_bytes", 0)) for w in pre)
    budget = sum(int((w.get("extra") or {}).get("kv_budget_bytes") or 0) for w in pre)
    usage = max(used / slots if slots else 0.0, held / budget if budget else 0.0)
    return admission_backlog + ready, used, min(1.0, usage)
