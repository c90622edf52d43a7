"""costd's assembly: the usage pipeline and the servicers over it, served by llmmesh.server."""
from __future__ import annotations

import logging
from collections.abc import Callable

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client import CollectorRegistry

from costd.access import CostAccess
from costd.billing import Billing
from costd.config import CostdConfig
from costd.ledger import UsageLedger
from costd.metrics import CostdMetrics
from costd.pipeline import Pipeline
from costd.pricebook import PriceBook
from costd.receiver import TraceReceiver
from costd.reconcile.timer import start_timer
from costd.service import CostServicer
from costd.usage import UsageProcessor
from costd.whatif.curve import load_curves
from costd.whatif.planner import WhatIfPlanner
from llmmesh import metrics, server
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity
from llmmesh.v1 import cost_pb2, cost_pb2_grpc

log = logging.getLogger("costd")

SERVICE_NAMES = server.service_names(
    cost_pb2.DESCRIPTOR.services_by_name["CostService"],
    trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"])


class CostPipeline(Pipeline):
    """OTLP receiver → usage processor → ledger; start opens the ledger, shutdown closes it.

    Pricing is not a stage: the ledger keeps what was used, and prices apply when a bill is
    read, so a corrected price book re-prices history without rewriting the ledger.
    """

    def __init__(self, ledger: UsageLedger) -> None:
        self.ledger = ledger
        processor = UsageProcessor(next_consumer=ledger)
        self.receiver = TraceReceiver(next_consumer=processor)
        super().__init__([self.receiver, processor, ledger])


def build_servicers(pipeline: CostPipeline, planner: WhatIfPlanner, config: CostdConfig,
                    access: CostAccess) -> list[tuple[Callable, object]]:
    """(add_XServicer_to_server, servicer) pairs, in the order of SERVICE_NAMES."""
    billing = Billing(pipeline.ledger, planner.book)
    servicer = CostServicer(pipeline.ledger, billing, planner, config.idle_policy, access=access)
    return [
        (cost_pb2_grpc.add_CostServiceServicer_to_server, servicer),
        (trace_service_pb2_grpc.add_TraceServiceServicer_to_server, pipeline.receiver),
    ]


async def serve(config: CostdConfig) -> None:
    """Runs until SIGTERM/SIGINT; the ledger closes only after in-flight exports committed."""
    identity = MeshIdentity.from_env(Role.COSTD, config.tls_dir)
    # Read before the ledger opens: a bad price book or curve fails start-up, not a bill.
    book = PriceBook.load(config.prices_path)
    planner = WhatIfPlanner(book, load_curves(config.curves_dir))
    access = CostAccess(config.tenants_path)
    pipeline = CostPipeline(UsageLedger(config.ledger))
    registry = None
    if config.metrics_port >= 0:
        registry = CollectorRegistry()
        pipeline.ledger.metrics = pipeline.receiver.metrics = CostdMetrics(registry, book)
        metrics.serve(config.metrics_port, registry, config.metrics_host)
    await pipeline.start()
    stop_reconciling = start_timer(config.redis_url, config.reconcile_interval_s,
                                   pipeline.ledger, registry)
    try:
        spec = server.ServiceSpec(servicers=build_servicers(pipeline, planner, config, access),
                                  service_names=SERVICE_NAMES, identity=identity)
        log.info("ledger %s, prices %s (%s), %d curves from %s", config.ledger.display,
                 config.prices_path, book.currency, len(planner.curves), config.curves_dir)
        await server.serve(spec, config.listen, grace_s=config.grace_s)
    finally:
        # Here, not in spec.on_shutdown: the ledger must close even when serving never began.
        await stop_reconciling()
        await pipeline.shutdown()
    log.info("costd stopped")
