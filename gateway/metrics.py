"""The gateway's metrics: the GenAI server histograms per request, and admissions by outcome."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from llmmesh.metrics import GenAIServerMetrics

# Admission outcomes, a bounded vocabulary (llmmesh.admission's refusal codes by name).
ADMISSION_OUTCOMES = {0: "admitted", 1: "requests_per_minute", 2: "tokens_per_minute",
                      3: "max_concurrent", 4: "token_budget", 5: "request_id_in_use",
                      6: "queue_full"}


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.genai = GenAIServerMetrics(registry)
        self.admissions = Counter("llmmesh_admissions", "Admission decisions by outcome "
                                  "(admitted, or the limit that refused)",
                                  ("tenant", "class", "outcome"), registry=registry)

    def admission(self, tenant: str, request_class: str, code: int) -> None:
        self.admissions.labels(tenant, request_class, ADMISSION_OUTCOMES.get(code, "other")).inc()

    def request(self, *, operation: str, model: str, tenant: str, request_class: str,
                start: float, first: float | None, last: float | None, num_output: int,
                num_input: int, end: float, error_type: str) -> None:
        g = self.genai
        labels = g.labels(operation, model, tenant, request_class)
        if first is not None:
            g.ttft.labels(*labels).observe(first - start)
            if num_output > 1 and last is not None:
                g.tpot.labels(*labels).observe((last - first) / (num_output - 1))
        g.duration.labels(*labels, error_type).observe(end - start)
        if not error_type:
            g.tokens.labels(*labels, "input").observe(num_input)
            g.tokens.labels(*labels, "output").observe(num_output)
