"""Prometheus metrics, one registry per app (no global state). Names follow vLLM's, under
the `tritonserve:` prefix; every latency is measured from arrival at the server."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tritonserve.engine import Completion

PREFIX = "tritonserve:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, async_engine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds",
                              "Arrival to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}request_time_per_output_token_seconds",
                              "Mean time between output tokens of a request",
                              buckets=TPOT_BUCKETS, registry=r)
        self.queue_time = Histogram(f"{PREFIX}request_queue_time_seconds",
                                    "Arrival to first scheduled", buckets=LATENCY_BUCKETS,
                                    registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Arrival to finish",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Sampled output tokens",
                                         registry=r)
        self.finished = Counter(f"{PREFIX}request_success", "Finished requests",
                                ["finish_reason"], registry=r)
        self.failed = Counter(f"{PREFIX}request_failure", "Requests ended by an error event",
                              ["code"], registry=r)
        Gauge(f"{PREFIX}num_requests_running", "Requests in the running batch",
              registry=r).set_function(lambda: async_engine.stats.num_running)
        Gauge(f"{PREFIX}num_requests_waiting", "Requests waiting to be scheduled",
              registry=r).set_function(lambda: async_engine.num_waiting)
        Gauge(f"{PREFIX}kv_cache_usage_perc", "KV blocks owned by live requests / total",
              registry=r).set_function(lambda: async_engine.stats.kv_cache_usage)
        r.register(_EngineCounters(async_engine))
        r.register(_PerEngine(async_engine))

    def observe_completion(self, done: Completion) -> None:
        t = done.timing
        self.ttft.observe(t.ttft_s)
        self.queue_time.observe(t.queue_wait_s)
        self.e2e.observe(t.total_s)
        if done.output_tokens > 1:
            self.tpot.observe((t.finish - t.first_token) / (done.output_tokens - 1))
        self.prompt_tokens.inc(done.prompt_tokens)
        self.generation_tokens.inc(done.output_tokens)
        self.finished.labels(done.reason.value).inc()

    def observe_failure(self, code: str) -> None:
        self.failed.labels(code).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCounters:
    """Totals the engine keeps itself (read from its latest stats snapshot), as counters:
    vLLM's prefix_cache_queries / prefix_cache_hits (tokens) and num_preemptions."""

    def __init__(self, async_engine) -> None:
        self.async_engine = async_engine

    def collect(self):
        stats = self.async_engine.stats
        for name, doc, value in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                 stats.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt tokens whose KV blocks the prefix cache held",
                 stats.prefix_cache_hits),
                ("num_preemptions", "Requests preempted for KV blocks", stats.num_preemptions),
                # vLLM's spec_decode_* counters: acceptance rate = accepted / draft tokens,
                # mean accepted length = 1 + accepted / drafts
                ("spec_decode_num_drafts", "Speculating request-steps", stats.spec_drafts),
                ("spec_decode_num_draft_tokens", "Proposed tokens verified",
                 stats.spec_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                 stats.spec_accepted_tokens)):
            yield CounterMetricFamily(f"{PREFIX}{name}", doc, value=value)


class _PerEngine:
    """Each engine's own figures, labelled engine="i" (one engine: "0"); the unlabelled
    families above are their sums. Data-parallel routing reads as outstanding tokens and
    prefix hits per engine; a dead engine reads engine_alive 0."""

    def __init__(self, async_engine) -> None:
        self.async_engine = async_engine

    def collect(self):
        views = self.async_engine.engines()
        families = (
            (GaugeMetricFamily, "engine_alive", "1 while the engine serves, 0 once it died",
             lambda v: float(v.alive)),
            (GaugeMetricFamily, "engine_num_requests_running", "Requests in its running batch",
             lambda v: v.stats.num_running),
            (GaugeMetricFamily, "engine_num_requests_waiting", "Requests in its queue",
             lambda v: v.stats.num_waiting),
            (GaugeMetricFamily, "engine_kv_cache_usage_perc", "Its KV blocks in use / total",
             lambda v: v.stats.kv_cache_usage),
            (GaugeMetricFamily, "engine_outstanding_tokens", "Tokens the router counts as "
             "still to compute for its requests", lambda v: v.outstanding_tokens),
            (CounterMetricFamily, "engine_prefix_cache_queries", "Its prompt tokens looked up",
             lambda v: v.stats.prefix_cache_queries),
            (CounterMetricFamily, "engine_prefix_cache_hits", "Its prompt tokens found cached",
             lambda v: v.stats.prefix_cache_hits))
        for kind, name, doc, value in families:
            family = kind(f"{PREFIX}{name}", doc, labels=["engine"])
            for view in views:
                family.add_metric([str(view.index)], value(view))
            yield family
