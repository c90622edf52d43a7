"""OTLP receiver behind the shared interceptor: the status a sender sees decides if it retries."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from costd.pipeline import PermanentError, Rejection, RetryableError
from costd.receiver import MAX_REASONS_IN_MESSAGE, TraceReceiver, partial_success
from llmmesh.server import ErrorMappingInterceptor

REQUEST = trace_service_pb2.ExportTraceServiceRequest(
    resource_spans=[{"scope_spans": [{"spans": [{"name": "a"}, {"name": "b"}]}]}])


class Raising:
    def __init__(self, error: Exception) -> None:
        self.error = error

    async def consume(self, batch):
        raise self.error


async def export_through_server(consumer) -> grpc.StatusCode:
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()])
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceReceiver(consumer), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            try:
                await stub.Export(REQUEST, timeout=5)
            except grpc.aio.AioRpcError as error:
                return error.code()
            return grpc.StatusCode.OK
    finally:
        await server.stop(None)


@pytest.mark.parametrize("error, code", [
    # OTLP senders retry UNAVAILABLE: a busy or full ledger must not lose the batch.
    (RetryableError("database is locked"), grpc.StatusCode.UNAVAILABLE),
    (PermanentError("corrupt"), grpc.StatusCode.INTERNAL),
    (ValueError("a bug"), grpc.StatusCode.INTERNAL),
])
def test_ledger_failures_map_to_the_status_senders_act_on(error, code):
    assert asyncio.run(export_through_server(Raising(error))) == code


def test_receiver_hands_every_span_of_every_resource_to_the_next_stage():
    seen = []

    class Collect:
        async def consume(self, batch):
            seen.extend(span.name for span in batch)
            return ()

    assert asyncio.run(export_through_server(Collect())) == grpc.StatusCode.OK
    assert seen == ["a", "b"]


def test_partial_success_counts_all_rejections_but_bounds_the_message():
    rejections = [Rejection(f"span {i}", "bad") for i in range(MAX_REASONS_IN_MESSAGE + 3)]
    answer = partial_success(rejections)
    assert answer.rejected_spans == MAX_REASONS_IN_MESSAGE + 3
    assert answer.error_message.endswith("; and 3 more")
    assert partial_success([]) is None
