"""The gateway's Prometheus metrics, on a registry of its own (one per app, so tests can build
several apps in one process and `/metrics` shows only what the gateway measures).

Latencies are measured where the client sees them: at the gateway, per relayed token.
`tandem_queue_seconds` is taken on the Redis clock (admission entry id -> first token entry id),
so gateway/worker clock skew does not enter it; it covers queueing plus prefill because the
gateway cannot see when a prefill pod claims the entry.
"""
from __future__ import annotations

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

    def render(self) -> bytes:
        return generate_latest(self.registry)
