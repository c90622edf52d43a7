"""costd's metrics: what arrives, what is billed, what is refused, how far the ledger lags."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge


class CostdMetrics:
    def __init__(self, registry: CollectorRegistry):
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

    def committed(self, batches, num_new: int) -> None:
        records = [r for b in batches for r in b.usage]
        self.commits.inc()
        if records:
            self.records.labels("billed").inc(num_new)
            self.records.labels("duplicate").inc(len(records) - num_new)
            newest = max(r.end_unix_ns for r in records)
            self.lag.set(max(0.0, time.time() - newest / 1e9))
