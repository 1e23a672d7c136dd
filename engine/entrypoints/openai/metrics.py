"""Prometheus metrics of the server: gauges read from the engine at scrape time, counters and
latency histograms observed as requests progress."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class _EngineCollector:
    """Reads the engine's counters when Prometheus scrapes, one sample per data-parallel replica
    (label `replica`; "0" with one engine)."""

    def __init__(self, engine_client, model_name: str) -> None:
        self.engine_client = engine_client
        self.model_name = model_name

    def collect(self):
        states = self.engine_client.replica_states()
        names = ["model_name", "replica"]

        def family(kind, name: str, doc: str, value_of) -> GaugeMetricFamily:
            metric = kind(name, doc, labels=names)
            for replica, stats, error in states:
                metric.add_metric([self.model_name, str(replica)], value_of(stats, error))
            return metric

        def gauge(name: str, doc: str, field: str):
            return family(GaugeMetricFamily, name, doc, lambda s, e: getattr(s, field))

        def counter(name: str, doc: str, field: str):
            return family(CounterMetricFamily, name, doc, lambda s, e: getattr(s, field))

        yield gauge("llmctl:num_requests_running", "Requests in the running batch.",
                    "num_running")  # fmt: skip
        yield gauge("llmctl:num_requests_waiting", "Requests waiting to be scheduled.",
                    "num_waiting")  # fmt: skip
        yield gauge("llmctl:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
                    "kv_cache_usage")  # fmt: skip
        yield gauge("llmctl:prefix_cache_hit_rate", "Prompt tokens served by the prefix cache.",
                    "prefix_cache_hit_rate")  # fmt: skip
        yield counter("llmctl:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      "prefix_cache_queries")  # fmt: skip
        yield counter("llmctl:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      "prefix_cache_hits")  # fmt: skip
        yield counter("llmctl:prompt_tokens", "Prompt tokens admitted.", "prompt_tokens")
        yield counter("llmctl:generation_tokens", "Tokens generated.", "generation_tokens")
        yield counter("llmctl:num_preemptions", "Requests preempted for lack of KV blocks.",
                      "num_preemptions")  # fmt: skip
        yield family(GaugeMetricFamily, "llmctl:engine_alive",
                     "1 while the engine (replica) serves (/health 200), else 0.",
                     lambda s, e: 0.0 if e is not None else 1.0)  # fmt: skip
        # Supervision, per replica (EngineClient.supervision).
        replicas = self.engine_client.supervision()

        def supervision(metric_kind, name: str, doc: str, value_of):
            metric = metric_kind(name, doc, labels=names)
            for index, state in enumerate(replicas):
                metric.add_metric([self.model_name, str(index)], value_of(state))
            return metric

        yield supervision(GaugeMetricFamily, "llmctl:seconds_since_last_step",
                          "Seconds the engine has had requests without completing a step (0 idle).",
                          lambda s: s.seconds_waiting)  # fmt: skip
        yield supervision(GaugeMetricFamily, "llmctl:engine_stalled",
                          "1 while no step completed for --stall-timeout seconds with requests.",
                          lambda s: float(s.stalled))  # fmt: skip
        yield supervision(CounterMetricFamily, "llmctl:engine_restarts",
                          "Engine restarts (--restart-on-failure).",
                          lambda s: s.restarts)  # fmt: skip


class ServerMetrics:
    def __init__(self, engine_client, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine_client, model_name))
        labels = ["model_name"]
        self.time_to_first_token = Histogram(
            "llmctl:time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "llmctl:inter_token_latency_seconds",
            "Time between two tokens of one request.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e_latency = Histogram(
            "llmctl:e2e_request_latency_seconds",
            "Time from a request's arrival to its last token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.requests = Counter(
            "llmctl:request_success",
            "Requests finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name

    def render(self) -> bytes:
        return generate_latest(self.registry)
