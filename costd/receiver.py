"""The OTLP trace receiver: OpenTelemetry's TraceService/Export, feeding spans into the pipeline.

It answers per the OTLP spec: spans that can never be billed are counted in partial_success
(the sender must not retry them), while a ledger that may recover later answers UNAVAILABLE,
which OTLP senders retry with backoff — so an acknowledged export is always in the ledger.
"""
from __future__ import annotations

import logging

import grpc
from collections.abc import Sequence

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from costd import capacity, usage
from costd.pipeline import Consumer, Rejection, RetryableError
from llmmesh.identity import Role, peer_role

log = logging.getLogger(__name__)

# Enough reasons to find the broken sender, few enough to keep the response small.
MAX_REASONS_IN_MESSAGE = 5


# Which role alone may send a span that carries each billing flag: a forged or misrouted bill
# from any other identity is never billed (and cannot take a real request's ledger key first).
_SENDER_OF_FLAG = {usage.FINAL: Role.ROUTER, capacity.FINAL: Role.WORKER}


def sort_by_sender(spans: Sequence[Span], sender: Role | None) -> tuple[list[Span], list[Rejection]]:
    """The spans this sender may have billed, and a rejection for each it may not."""
    kept: list[Span] = []
    refused: list[Rejection] = []
    for span in spans:
        needed = {_SENDER_OF_FLAG[kv.key] for kv in span.attributes if kv.key in _SENDER_OF_FLAG}
        if needed and needed != {sender}:
            who = sender.value if sender else "no mesh identity"
            want = " and ".join(sorted(r.value for r in needed))
            refused.append(Rejection(f"span {span.span_id.hex() or '<no id>'}",
                                     f"billing spans are accepted only from {want} identities, "
                                     f"not from {who}"))
        else:
            kept.append(span)
    return kept, refused


def spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> list[Span]:
    return [span
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans]


def partial_success(
        rejections: Sequence[Rejection]) -> trace_service_pb2.ExportTracePartialSuccess | None:
    if not rejections:
        return None
    reasons = "; ".join(str(r) for r in rejections[:MAX_REASONS_IN_MESSAGE])
    if len(rejections) > MAX_REASONS_IN_MESSAGE:
        reasons += f"; and {len(rejections) - MAX_REASONS_IN_MESSAGE} more"
    return trace_service_pb2.ExportTracePartialSuccess(
        rejected_spans=len(rejections), error_message=f"rejected usage spans: {reasons}")


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Converts an Export call into one batch for the next stage and its answer back."""

    def __init__(self, next_consumer: Consumer[Sequence[Span]]) -> None:
        self._next = next_consumer
        self.metrics = None   # costd.metrics.CostdMetrics, or None
        # Billing spans refused for their sender's identity, since start (costd's log says each).
        self.num_refused_by_identity = 0

    async def start(self) -> None:
        pass  # The gRPC server carrying this servicer belongs to llmmesh.server.serve.

    async def shutdown(self) -> None:
        pass

    async def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,
                     context: grpc.aio.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        # Errors travel up to llmmesh.server's interceptor: RetryableError → UNAVAILABLE (the
        # sender keeps the spans and retries), anything else → INTERNAL.
        sender = peer_role(context)
        received = spans_of(request)
        spans, refused = sort_by_sender(received, sender)
        if self.metrics is not None:
            self.metrics.spans.labels(sender.value if sender else "unknown").inc(len(received))
            if refused:
                self.metrics.rejected.labels("sender_may_not_bill").inc(len(refused))
        if refused:
            self.num_refused_by_identity += len(refused)
            log.warning("refused %d billing spans for their sender (%d since start): %s",
                        len(refused), self.num_refused_by_identity, refused[0])
        try:
            rejections = [*refused, *await self._next.consume(spans)]
        except RetryableError as error:
            log.warning("export refused, sender will retry: %s", error)
            raise
        if rejections:
            log.warning("rejected %d usage spans: %s", len(rejections), rejections[0])
            if self.metrics is not None and len(rejections) > len(refused):
                self.metrics.rejected.labels("unusable").inc(len(rejections) - len(refused))
        return trace_service_pb2.ExportTraceServiceResponse(
            partial_success=partial_success(rejections))
