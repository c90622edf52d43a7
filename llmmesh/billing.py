"""A finished request's billing record, durable in Redis before its queue entry is acknowledged.

The router writes the record to `llmmesh:billing` in the same MULTI/EXEC as the request's final
event (or right after the error event that ended it with tokens delivered), and acknowledges
the queue entry only after that. Routers' shippers drain the stream to costd as OTLP spans and
acknowledge a record only once costd's Export answered (costd commits before it answers), so a
router killed at any instant, or costd down for minutes, loses no bill. A record may be shipped
twice (a router that took over an ended request writes it again, a shipper dies between the
answer and its XACK); the ledger is keyed by request id and keeps the first.
"""
from __future__ import annotations

import json
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from llmmesh import queue, vocab

BILLING_STREAM = f"{queue.PREFIX}:billing"
SHIPPER_GROUP = "shippers"
SPAN_NAME = "router bill"


def record_attributes(*, request_id: str, tenant_id: str, model: str, request_class: str,
                      usage: dict[str, Any], finish_reason: str, device_type: str,
                      worker_ids: list[str], operation: str = vocab.TEXT_COMPLETION) -> dict[str, Any]:
    """The billing span's attributes (GenAI conventions, then ours), as costd reads them."""
    return {
        vocab.USAGE_FINAL: True, vocab.REQUEST_ID: request_id,
        vocab.TENANT_ID: tenant_id, vocab.REQUEST_MODEL: model,
        vocab.REQUEST_CLASS: request_class, vocab.OPERATION: operation,
        vocab.PROVIDER: vocab.PROVIDER_NAME,
        vocab.INPUT_TOKENS: int(usage["prompt_tokens"]),
        vocab.OUTPUT_TOKENS: int(usage["completion_tokens"]),
        vocab.CACHE_READ_TOKENS: int(usage["cached_prompt_tokens"]),
        vocab.PREFILL_DEVICE_S: float(usage["prefill_device_s"]),
        vocab.DECODE_DEVICE_S: float(usage["decode_device_s"]),
        vocab.QUEUE_S: float(usage.get("queue_s", 0.0)),
        vocab.DEVICE_TYPE: device_type, vocab.WORKER_ID: ",".join(worker_ids),
        vocab.FINISH_REASONS: [finish_reason]}


def encode_record(attributes: dict[str, Any], *, start_unix_ns: int, end_unix_ns: int,
                  trace_id: str = "", parent_span_id: str = "") -> dict[str, str]:
    """Stream fields of one record; trace ids (hex) put the bill into its request's trace."""
    return {"d": json.dumps({"attributes": attributes, "start_unix_ns": start_unix_ns,
                             "end_unix_ns": end_unix_ns, "trace_id": trace_id,
                             "parent_span_id": parent_span_id}, separators=(",", ":"))}


def any_value(value: Any) -> AnyValue:
    """An OTLP attribute value of a plain Python one (bool before int: bool is an int)."""
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, list):
        return AnyValue(array_value=ArrayValue(values=[any_value(v) for v in value]))
    return AnyValue(string_value=str(value))


def _span(entry_id: str, body: dict) -> trace_pb2.Span:
    # A span id fixed by the stream entry: a record shipped twice is the same span twice.
    ms, _, seq = entry_id.partition("-")
    span_id = (int(ms) << 16 | int(seq or 0) & 0xFFFF).to_bytes(8, "big")
    return trace_pb2.Span(
        trace_id=bytes.fromhex(body.get("trace_id") or "") or span_id * 2, span_id=span_id,
        parent_span_id=bytes.fromhex(body.get("parent_span_id") or ""), name=SPAN_NAME,
        kind=trace_pb2.Span.SPAN_KIND_INTERNAL,
        start_time_unix_nano=int(body["start_unix_ns"]), end_time_unix_nano=int(body["end_unix_ns"]),
        attributes=[KeyValue(key=k, value=any_value(v)) for k, v in body["attributes"].items()])


def export_request(entries: list[tuple[str, dict]]) -> trace_service_pb2.ExportTraceServiceRequest:
    """One OTLP export of stream entries (id, fields), as the router service's spans."""
    spans = [_span(entry_id, json.loads(fields["d"])) for entry_id, fields in entries]
    return trace_service_pb2.ExportTraceServiceRequest(resource_spans=[{
        "resource": {"attributes": [KeyValue(key="service.name",
                                             value=AnyValue(string_value="llmmesh-router"))]},
        "scope_spans": [{"scope": {"name": "llmmesh.billing"}, "spans": spans}]}])
