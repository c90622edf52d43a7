"""costd's assembly: the usage pipeline and the servicers over it, served by llmmesh.server."""
from __future__ import annotations

import logging
from collections.abc import Callable

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from costd.config import CostdConfig
from costd.ledger import UsageLedger
from costd.pipeline import Pipeline
from costd.receiver import TraceReceiver
from costd.service import CostServicer
from costd.usage import UsageProcessor
from llmmesh import server
from llmmesh.v1 import cost_pb2, cost_pb2_grpc

log = logging.getLogger("costd")

SERVICE_NAMES = server.service_names(
    cost_pb2.DESCRIPTOR.services_by_name["CostService"],
    trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"])


class CostPipeline(Pipeline):
    """OTLP receiver → usage processor → ledger; start opens the ledger, shutdown closes it.

    A later stage (pricing with the price book) goes between the processor and the ledger.
    """

    def __init__(self, ledger: UsageLedger) -> None:
        self.ledger = ledger
        processor = UsageProcessor(next_consumer=ledger)
        self.receiver = TraceReceiver(next_consumer=processor)
        super().__init__([self.receiver, processor, ledger])


def build_servicers(pipeline: CostPipeline) -> list[tuple[Callable, object]]:
    """(add_XServicer_to_server, servicer) pairs, in the order of SERVICE_NAMES."""
    return [
        (cost_pb2_grpc.add_CostServiceServicer_to_server, CostServicer(pipeline.ledger)),
        (trace_service_pb2_grpc.add_TraceServiceServicer_to_server, pipeline.receiver),
    ]


async def serve(config: CostdConfig) -> None:
    """Runs until SIGTERM/SIGINT; the ledger closes only after in-flight exports committed."""
    pipeline = CostPipeline(UsageLedger(config.ledger))
    await pipeline.start()
    try:
        spec = server.ServiceSpec(servicers=build_servicers(pipeline),
                                  service_names=SERVICE_NAMES)
        log.info("ledger %s", config.ledger.path)
        await server.serve(spec, config.listen, grace_s=config.grace_s)
    finally:
        # Here, not in spec.on_shutdown: the ledger must close even when serving never began.
        await pipeline.shutdown()
    log.info("costd stopped")
