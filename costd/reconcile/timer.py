"""costd's reconciliation timer: every interval, the last window reconciled and repaired; open
gaps logged as warnings and exported as Prometheus metrics."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge

from costd.ledger import UsageLedger
from costd.reconcile.reconciler import MISMATCH, UNBILLED, UNKNOWN, Reconciler, Report
from llmmesh import redis_acl

log = logging.getLogger("costd.reconcile")
# Each run looks back this far: a gap that an outage delayed past one run is still found.
WINDOW_S = 3600.0
MAX_LOGGED_GAPS = 20


class ReconcileMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.gaps = Gauge("llmmesh_costd_reconcile_gaps", "Gaps the last reconciliation left "
                          "open (unbilled, mismatch, unknown), by kind", ("kind",),
                          registry=registry)
        self.repaired = Counter("llmmesh_costd_reconcile_repaired", "Bills the reconciler "
                                "wrote to the ledger from a billing record still in Redis",
                                registry=registry)
        self.runs = Counter("llmmesh_costd_reconcile_runs", "Reconciliation runs, by outcome "
                            "(ok, failed)", ("outcome",), registry=registry)

    def observed(self, report: Report) -> None:
        self.runs.labels("ok").inc()
        self.repaired.inc(report.num_repaired)
        for kind in (UNBILLED, MISMATCH, UNKNOWN):
            self.gaps.labels(kind).set(sum(g.kind == kind for g in report.open_gaps))


class ReconcileTimer:
    def __init__(self, reconciler: Reconciler, interval_s: float, window_s: float = WINDOW_S,
                 metrics: ReconcileMetrics | None = None) -> None:
        self.reconciler, self.interval_s, self.window_s = reconciler, interval_s, window_s
        self.metrics = metrics

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.run_once()

    async def run_once(self) -> Report | None:
        try:
            report = await self.reconciler.run(self.window_s, repair=True)
        except Exception:  # noqa: BLE001 - Redis or the ledger away: the next run tries again
            log.exception("reconciliation failed; next try in %.0f s", self.interval_s)
            if self.metrics is not None:
                self.metrics.runs.labels("failed").inc()
            return None
        if self.metrics is not None:
            self.metrics.observed(report)
        gaps = report.open_gaps
        for gap in gaps[:MAX_LOGGED_GAPS]:
            log.warning("reconcile: %s request %s of tenant %s (redis %s tokens, ledger %s): %s",
                        gap.kind, gap.request_id, gap.tenant_id, gap.redis_tokens,
                        gap.ledger_tokens, gap.detail)
        if gaps or report.num_repaired:
            log.warning("reconcile: %d gaps open, %d repaired in the last %.0f s",
                        len(gaps), report.num_repaired, self.window_s)
        return report


def start_timer(redis_url: str, interval_s: float, ledger: UsageLedger,
                registry: CollectorRegistry | None) -> Callable[[], Awaitable[None]]:
    """Starts the timer (none without a Redis URL or with interval 0); returns its stop."""
    if not redis_url or interval_s <= 0:
        async def nothing() -> None:
            return None
        return nothing
    redis = aioredis.Redis.from_url(redis_acl.service_url(redis_url, "costd"), decode_responses=True, socket_connect_timeout=2.0)
    metrics = ReconcileMetrics(registry) if registry is not None else None
    timer = ReconcileTimer(Reconciler(redis, ledger), interval_s, metrics=metrics)
    task = asyncio.create_task(timer.run(), name="reconcile")
    log.info("reconciling the last %.0f s with Redis every %.0f s", timer.window_s, interval_s)

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await redis.aclose()
    return stop
