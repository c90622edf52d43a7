"""The gateway's metrics: the GenAI server histograms per request, and admissions by outcome."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from llmmesh.metrics import GenAIServerMetrics

# A budget period's length, for the average rate a budget allows (a month as 30 days).
_PERIOD_S = {"day": 86400.0, "month": 30 * 86400.0}

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
        self.stream_events_refused = Counter(
            "llmmesh_result_events_refused", "Result-stream events not relayed to a client: not "
            "signed by the request's current attempt or its router, or out of order "
            "(llmmesh.streamauth); nonzero means a stranger or a replaced worker wrote",
            registry=registry)

    def watch_tenants(self, book) -> None:
        """Export each tenant's token budget as the average rate it allows, so a burn-rate
        alert can compare it with gen_ai_client_token_usage (deploy/prometheus/alerts.yml)."""
        self.book = book
        self.registry.register(self)

    def collect(self):
        g = GaugeMetricFamily("llmmesh_tenant_token_budget_rate", "Tokens per second the "
                              "tenant's budget allows on average over its period (0: none)",
                              labels=["tenant", "period"])
        for t in self.book.tenants():
            period_s = _PERIOD_S.get(t.plan.budget_period)
            rate = t.plan.token_budget / period_s if t.plan.token_budget and period_s else 0.0
            g.add_metric([t.tenant_id, t.plan.budget_period], rate)
        return [g]

    def stream_event_refused(self) -> None:
        self.stream_events_refused.inc()

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
