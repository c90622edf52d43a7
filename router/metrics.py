"""The router's metrics: the queues as Redis holds them (sampled), dispatch latency and
outcomes, and each worker's health and circuit as this router sees them."""
from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from redis.exceptions import RedisError

from llmmesh import queue
from llmmesh.vocab import CLASSES
from llmmesh.metrics import TTFT_BUCKETS
from router.breaker import CircuitState

log = logging.getLogger("router.metrics")
SAMPLE_S = 1.0


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry, redis, workers_of):
        self.redis, self.registry = redis, registry
        self.workers_of = workers_of          # () -> the registry's current WorkerHandles
        self.queues: dict[str, dict[str, float]] = {}
        self.dispatch_latency = Histogram(
            "llmmesh_dispatch_latency", "Enqueue at the gateway to the first call to a worker",
            ("class",), unit="seconds", buckets=TTFT_BUCKETS, registry=registry)
        self.outcomes = Counter("llmmesh_router_requests", "Requests this router ended, by "
                                "outcome (ok, or the gRPC status name of the error)",
                                ("class", "outcome"), registry=registry)
        registry.register(self)

    def dispatched(self, request_class: str, enqueued_unix_ns: int) -> None:
        if enqueued_unix_ns:
            self.dispatch_latency.labels(request_class).observe(
                max(0.0, time.time_ns() - enqueued_unix_ns) / 1e9)

    def ended(self, request_class: str, error_code: str) -> None:
        self.outcomes.labels(request_class, error_code or "ok").inc()

    async def sample_queues(self) -> None:
        """A supervised loop: what each class's stream holds, once a second."""
        while True:
            now_ms = time.time() * 1000
            for cls in CLASSES:
                stream = queue.queue_stream(cls)
                try:
                    depth = await self.redis.xlen(stream)
                    first = await self.redis.xrange(stream, "-", "+", count=1)
                    groups = await self.redis.xinfo_groups(stream) if depth else []
                except RedisError:
                    continue
                group = next((g for g in groups if g.get("name") == queue.ROUTER_GROUP), {})
                oldest_ms = int(first[0][0].split("-")[0]) if first else now_ms
                self.queues[cls] = {"depth": depth, "pending": group.get("pending", 0) or 0,
                                    "lag": group.get("lag", 0) or 0,
                                    "oldest_s": max(0.0, now_ms - oldest_ms) / 1000}
            await asyncio.sleep(SAMPLE_S)

    def collect(self):
        depth = GaugeMetricFamily("llmmesh_queue_depth", "Entries in the class's stream "
                                  "(waiting or running; ended ones are deleted)", labels=["class"])
        pending = GaugeMetricFamily("llmmesh_queue_pending", "Entries read by a router and not "
                                    "yet acknowledged", labels=["class"])
        lag = GaugeMetricFamily("llmmesh_queue_lag", "Entries no router has read yet (the "
                                "consumer group's lag: what KEDA scales workers on)", labels=["class"])
        oldest = GaugeMetricFamily("llmmesh_queue_oldest_age_seconds", "Age of the oldest entry "
                                   "in the class's stream", labels=["class"])
        for cls, q in list(self.queues.items()):
            depth.add_metric([cls], q["depth"])
            pending.add_metric([cls], q["pending"])
            lag.add_metric([cls], q["lag"])
            oldest.add_metric([cls], q["oldest_s"])
        healthy = GaugeMetricFamily("llmmesh_worker_healthy", "1 while the worker's lease and "
                                    "load probe are good and its circuit lets requests through",
                                    labels=["worker"])
        circuit = GaugeMetricFamily("llmmesh_worker_circuit_state", "1 for the circuit state "
                                    "this router holds for the worker", labels=["worker", "state"])
        inflight = GaugeMetricFamily("llmmesh_worker_inflight", "Requests this router has on "
                                     "the worker", labels=["worker"])
        for h in list(self.workers_of()):
            open_ = h.breaker is not None and not h.breaker.available()
            healthy.add_metric([h.worker_id], float(h.healthy and not open_))
            state = h.breaker.state if h.breaker is not None else CircuitState.CLOSED
            for s in CircuitState:
                circuit.add_metric([h.worker_id, s.value], float(s is state))
            inflight.add_metric([h.worker_id], h.num_inflight)
        return [depth, pending, lag, oldest, healthy, circuit, inflight]
