"""costd's metrics: what arrives, what is billed, what is refused, how far the ledger lags."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge


class CostdMetrics:
    def __init__(self, registry: CollectorRegistry, book=None):
        self.book = book     # costd.pricebook.PriceBook: prices the attributed device time
        self.spans = Counter("llmmesh_costd_spans_received", "Spans received over OTLP, by the "
                             "sender's mesh role", ("sender",), registry=registry)
        self.rejected = Counter("llmmesh_costd_spans_rejected", "Usage spans refused: from a "
                                "role that may not bill, or unusable", ("reason",), registry=registry)
        self.records = Counter("llmmesh_costd_usage_records", "Usage records committed to the "
                               "ledger: billed (new) or duplicate (already there, not billed "
                               "again)", ("outcome",), registry=registry)
        self.lag = Gauge("llmmesh_costd_ledger_lag", "Seconds from the end of the newest request "
                         "in the last commit to that commit", unit="seconds", registry=registry)
        self.commits = Counter("llmmesh_costd_ledger_commits", "Ledger transactions committed",
                               registry=registry)
        self.cost = Counter("llmmesh_costd_attributed_cost", "Money billed per tenant for the "
                            "device time attributed to its requests, at the price book's price "
                            "when each ended (the invoice adds the tenant's share of idle "
                            "capacity on top)", ("tenant", "currency"), registry=registry)

    def committed(self, batches, result) -> None:
        records = [r for b in batches for r in b.usage]
        self.commits.inc()
        if not records:
            return
        self.records.labels("billed").inc(result.num_new_usage)
        self.records.labels("duplicate").inc(len(records) - result.num_new_usage)
        newest = max(r.end_unix_ns for r in records)
        self.lag.set(max(0.0, time.time() - newest / 1e9))
        if self.book is None:
            return
        seen = set(result.known_request_ids)
        for r in records:
            if r.request_id in seen:
                continue          # a repeat: billed when it first came
            seen.add(r.request_id)
            device = self.book.device_for(r.device_type)
            price = self.book.price(device, r.end_unix_ns) if device else None
            if price is not None:
                hours = (r.prefill_device_s + r.decode_device_s) / 3600
                self.cost.labels(r.tenant_id, self.book.currency).inc(float(price.per_hour) * hours)
