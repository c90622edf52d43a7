"""The worker's metrics, in the style vLLM users chart: requests running and waiting, KV-cache
usage, prefix-cache queries and hits, preemptions, step time and tokens per step."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmmesh.metrics import STEP_BUCKETS

TOKENS_PER_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, engine, worker_id: str, model: str):
        self.registry, self.engine = registry, engine
        self.labels = [worker_id, model]
        self.step = Histogram("llmmesh_engine_step", "Wall time of one engine step (the time "
                              "billed to the requests in it)", ("worker", "model"), unit="seconds",
                              buckets=STEP_BUCKETS, registry=registry).labels(*self.labels)
        self.tokens = Histogram("llmmesh_engine_tokens_per_step", "Tokens computed in one step "
                                "(prefill chunks and decodes together)", ("worker", "model"),
                                buckets=TOKENS_PER_STEP_BUCKETS, registry=registry).labels(*self.labels)
        registry.register(self)

    def on_step(self, step_s: float, num_tokens: int, num_requests: int) -> None:
        """Called from the engine's step thread (prometheus_client's observe is thread-safe)."""
        self.step.observe(step_s)
        self.tokens.observe(num_tokens)

    def collect(self):
        names = ["worker", "model"]
        out = []
        try:
            load = self.engine.load()
            scheduler = self.engine.scheduler
        except RuntimeError:
            return out      # not started yet
        for name, help_, value in (
                ("llmmesh_requests_running", "Requests in the running batch", load.num_running),
                ("llmmesh_requests_waiting", "Requests admitted by the worker, waiting for a slot",
                 load.num_waiting),
                ("llmmesh_kv_cache_usage_ratio", "Share of KV-cache blocks in use (cached-idle "
                 "blocks count as free)", 1 - load.num_free_blocks / max(1, load.num_total_blocks))):
            g = GaugeMetricFamily(name, help_, labels=names)
            g.add_metric(self.labels, value)
            out.append(g)
        for name, help_, value in (
                ("llmmesh_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                 scheduler.num_prefix_query_tokens),
                ("llmmesh_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                 scheduler.num_prefix_hit_tokens),
                ("llmmesh_preemptions", "Requests preempted (recomputed later) to make room",
                 scheduler.num_preemptions)):
            c = CounterMetricFamily(name, help_, labels=names)
            c.add_metric(self.labels, value)
            out.append(c)
        return out
