"""costd's assembly: the usage pipeline, the servicers over it, and the gRPC server's lifetime."""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from costd.config import CostdConfig
from costd.ledger import UsageLedger
from costd.pipeline import Pipeline
from costd.receiver import TraceReceiver
from costd.service import CostServicer
from costd.usage import UsageProcessor
from llmmesh.v1 import cost_pb2, cost_pb2_grpc

log = logging.getLogger("costd")

TRACE_SERVICE = trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name
COST_SERVICE = cost_pb2.DESCRIPTOR.services_by_name["CostService"].full_name


class CostPipeline(Pipeline):
    """OTLP receiver → usage processor → ledger; start opens the ledger, shutdown closes it."""

    def __init__(self, ledger: UsageLedger) -> None:
        self.ledger = ledger
        processor = UsageProcessor(next_consumer=ledger)
        self.receiver = TraceReceiver(next_consumer=processor)
        super().__init__([self.receiver, processor, ledger])


@dataclass(frozen=True, slots=True)
class ServicerBinding:
    """What a gRPC bootstrap needs per service: its name (health, reflection) and how to add it."""

    service_name: str
    servicer: object
    add_to_server: Callable[[object, grpc.aio.Server], None]


def build_servicers(pipeline: CostPipeline) -> list[ServicerBinding]:
    return [
        ServicerBinding(TRACE_SERVICE, pipeline.receiver,
                        trace_service_pb2_grpc.add_TraceServiceServicer_to_server),
        ServicerBinding(COST_SERVICE, CostServicer(pipeline.ledger),
                        cost_pb2_grpc.add_CostServiceServicer_to_server),
    ]


async def _set_serving(servicer: health.aio.HealthServicer, service_names: list[str]) -> None:
    # "" is the whole server: what `grpc_health_probe` and load balancers ask by default.
    for name in ["", *service_names]:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def _until_stop_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


async def _run_server(config: CostdConfig, pipeline: CostPipeline) -> None:
    server = grpc.aio.server()
    bindings = build_servicers(pipeline)
    for binding in bindings:
        binding.add_to_server(binding.servicer, server)
    names = [binding.service_name for binding in bindings]
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(config.listen)
    await server.start()
    try:
        await _set_serving(health_servicer, names)
        host = config.listen.rpartition(":")[0]
        log.info("costd serving on %s:%d, ledger %s", host, port, config.ledger.path)
        await _until_stop_signal()
        log.info("costd stopping (grace %.1f s)", config.grace_s)
        # NOT_SERVING first, so balancers drain before in-flight exports are cut off.
        await health_servicer.enter_graceful_shutdown()
    finally:
        await server.stop(config.grace_s)


async def serve(config: CostdConfig) -> None:
    """Runs until SIGTERM/SIGINT; the ledger closes only after in-flight exports committed."""
    pipeline = CostPipeline(UsageLedger(config.ledger))
    await pipeline.start()
    try:
        await _run_server(config, pipeline)
    finally:
        await pipeline.shutdown()
    log.info("costd stopped")
