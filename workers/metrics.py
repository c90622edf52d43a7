"""The worker's metrics, in the style vLLM users chart: requests running and waiting, KV-cache
usage, prefix-cache queries and hits, preemptions, step time and tokens per step."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmmesh.metrics import STEP_BUCKETS

TOKENS_PER_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, engine, worker_id: str, host=None):
        self.registry, self.engine, self.host = registry, engine, host
        self.worker_id = worker_id
        self.step = Histogram("llmmesh_engine_step", "Wall time of one engine step (the time "
                              "billed to the requests in it)", ("worker", "model"), unit="seconds",
                              buckets=STEP_BUCKETS, registry=registry)
        self.tokens = Histogram("llmmesh_engine_tokens_per_step", "Tokens computed in one step "
                                "(prefill chunks and decodes together)", ("worker", "model"),
                                buckets=TOKENS_PER_STEP_BUCKETS, registry=registry)
        registry.register(self)

    def on_step(self, model: str, step_s: float, num_tokens: int, num_requests: int) -> None:
        """Called from the engine's step thread (prometheus_client's observe is thread-safe)."""
        self.step.labels(self.worker_id, model).observe(step_s)
        self.tokens.labels(self.worker_id, model).observe(num_tokens)

    def collect(self):
        out = []
        for model in self.engine.models:
            try:
                out += self._collect_model(model)
            except (RuntimeError, KeyError):
                continue    # not started yet, or unloaded meanwhile
        if self.host is not None:
            g = GaugeMetricFamily("llmmesh_model_loaded", "1 while a catalog model is loaded on "
                                  "this worker (0: servable, not loaded)",
                                  labels=["worker", "model", "state"])
            mem = GaugeMetricFamily("llmmesh_model_memory_bytes", "Weights + KV pool of a loaded "
                                    "model (estimate when not loaded)", labels=["worker", "model"])
            loads = CounterMetricFamily("llmmesh_model_loads", "Models loaded since start",
                                        labels=["worker"])
            for s in self.host.states():
                g.add_metric([self.worker_id, s.name, s.state], 1.0 if s.state == "loaded" else 0.0)
                mem.add_metric([self.worker_id, s.name], s.memory_bytes)
            loads.add_metric([self.worker_id], self.host.num_loads)
            out += [g, mem, loads]
        return out

    def _collect_model(self, model: str):
        names, labels, out = ["worker", "model"], [self.worker_id, model], []
        load = self.engine.load(model)
        scheduler = self.engine.core_of(model).scheduler
        for name, help_, value in (
                ("llmmesh_requests_running", "Requests in the running batch", load.num_running),
                ("llmmesh_requests_waiting", "Requests admitted by the worker, waiting for a slot",
                 load.num_waiting),
                ("llmmesh_kv_cache_usage_ratio", "Share of KV-cache blocks in use (cached-idle "
                 "blocks count as free)", 1 - load.num_free_blocks / max(1, load.num_total_blocks))):
            g = GaugeMetricFamily(name, help_, labels=names)
            g.add_metric(labels, value)
            out.append(g)
        for name, help_, value in (
                ("llmmesh_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                 scheduler.num_prefix_query_tokens),
                ("llmmesh_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                 scheduler.num_prefix_hit_tokens),
                ("llmmesh_preemptions", "Requests preempted (recomputed later) to make room",
                 scheduler.num_preemptions)):
            c = CounterMetricFamily(name, help_, labels=names)
            c.add_metric(labels, value)
            out.append(c)
        return out
