"""Prometheus metrics (prometheus-client), on a registry of their own so several apps can coexist."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5,
                    2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512)


class _EngineCollector:
    """Gauges read from the engine thread's latest stats snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], dict | None]):
        self._snapshot = snapshot

    def collect(self):
        s = self._snapshot()
        ready = GaugeMetricFamily("jaxserve_ready", "1 once the model is loaded and compiled")
        ready.add_metric([], 1.0 if s is not None else 0.0)
        yield ready
        if s is None:
            return
        gauges = {
            "jaxserve_num_requests_running": ("sequences in the running batch", s.get("num_running", 0)),
            "jaxserve_num_requests_waiting": ("requests waiting for admission (the queue)",
                                              s.get("num_requests_waiting", s.get("num_waiting", 0))),
            "jaxserve_num_seqs_waiting": ("sequences waiting for admission", s.get("num_waiting", 0)),
            "jaxserve_kv_blocks_total": ("usable KV cache blocks", s.get("kv_blocks_total", 0)),
            "jaxserve_kv_blocks_used": ("KV cache blocks referenced by live sequences", s.get("kv_blocks_used", 0)),
            "jaxserve_kv_blocks_free": ("KV cache blocks free or evictable", s.get("kv_blocks_free", 0)),
        }
        for name, (doc, v) in gauges.items():
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(v))
            yield g
        total = s.get("kv_blocks_total", 0) or 1
        g = GaugeMetricFamily("jaxserve_kv_cache_usage_ratio", "share of KV blocks in use")
        g.add_metric([], s.get("kv_blocks_used", 0) / total)
        yield g
        counters = {
            "jaxserve_prefix_cache_hit_tokens": ("prompt tokens served from the prefix cache",
                                                 s.get("prefix_cache_hit_tokens", 0)),
            "jaxserve_prefix_cache_query_tokens": ("prompt tokens looked up in the prefix cache",
                                                   s.get("prefix_cache_query_tokens", 0)),
            "jaxserve_engine_steps": ("engine steps run", s.get("num_steps", 0)),
            "jaxserve_preemptions": ("sequences preempted (recomputed later)", s.get("num_preemptions", 0)),
            "jaxserve_engine_step_failures": ("engine steps that raised", s.get("steps_failed", 0)),
            "jaxserve_spec_decode_draft_tokens": ("speculative tokens proposed (prompt lookup)",
                                                  s.get("spec_draft_tokens", 0)),
            "jaxserve_spec_decode_accepted_tokens": ("speculative tokens the model agreed with",
                                                     s.get("spec_accepted_tokens", 0)),
        }
        for name, (doc, v) in counters.items():
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(v))
            yield c


class Metrics:
    def __init__(self, snapshot: Callable[[], dict | None]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("jaxserve_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.finished = Counter("jaxserve_request_finished", "generations (choices) ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("jaxserve_prompt_tokens", "prompt tokens submitted", registry=r)
        self.generation_tokens = Counter("jaxserve_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds", "time from arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("jaxserve_time_per_output_token_seconds",
                              "mean time between output tokens of a generation", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram("jaxserve_e2e_request_latency_seconds", "time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("jaxserve_batch_size", "sequences per engine step",
                                    buckets=_BATCH_BUCKETS, registry=r)
        r.register(_EngineCollector(snapshot))

    def on_step(self, stats: dict, batch: int) -> None:  # engine thread; prometheus-client is thread-safe
        if batch > 0:
            self.batch_size.observe(batch)

    def render(self) -> bytes:
        return generate_latest(self.registry)
