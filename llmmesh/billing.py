"""A finished request's billing record, durable in Redis before its queue entry is acknowledged.

The router writes the record to `llmmesh:billing` in the same MULTI/EXEC as the request's final
event (or right after the error event that ended it with tokens delivered), and acknowledges
the queue entry only after that. Routers' shippers drain the stream to costd as OTLP spans and
acknowledge a record only once costd's Export answered (costd commits before it answers), so a
router killed at any instant, or costd down for minutes, loses no bill. A record may be shipped
twice (a router that took over an ended request writes it again, a shipper dies between the
answer and its XACK); the ledger is keyed by request id and keeps the first.

Shipped records stay in the stream for RETENTION_S (as long as admission settlements), so the
reconciler (costd.reconcile) can compare them with the ledger and re-ship one it lacks; only
records a shipper acknowledged are ever trimmed.
"""
from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from llmmesh import queue, vocab

BILLING_STREAM = f"{queue.PREFIX}:billing"
SHIPPER_GROUP = "shippers"
SPAN_NAME = "router bill"
RETENTION_S = 86400
_PAGE = 1000

log = logging.getLogger("llmmesh.billing")


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


def lost_request_record(*, request_id: str, tenant_id: str, model: str, request_class: str,
                        operation: str, num_prompt_tokens: int, num_delivered_tokens: int,
                        enqueued_unix_ns: int) -> dict[str, str]:
    """The bill its gateway writes for a request Redis lost with its data: the tokens that
    reached the client (the only ones anybody can still count), no device time (unknown: it
    falls into idle capacity), ended in an error like every request its router ends early."""
    usage = {"prompt_tokens": num_prompt_tokens, "cached_prompt_tokens": 0,
             "completion_tokens": num_delivered_tokens, "prefill_device_s": 0.0,
             "decode_device_s": 0.0}
    now = time.time_ns()
    return encode_record(record_attributes(
        request_id=request_id, tenant_id=tenant_id, model=model, request_class=request_class,
        usage=usage, finish_reason="error", device_type="", worker_ids=[], operation=operation),
        start_unix_ns=enqueued_unix_ns or now, end_unix_ns=now)


class RecentBills:
    """Bills this process saw written lately, to write again if Redis loses its data.

    A bill waits in `llmmesh:billing` until a shipper has costd's answer: a Redis that comes back
    empty (no append-only file, or a new one) takes the unshipped ones with it. The gateway keeps
    the bill each final carries (the router puts it there), the router those of requests no
    gateway relays (batch-job items); after a wipe (llmmesh.epoch) each writes them again, and
    the ledger, keyed by request id, keeps one. Bounded by count and age: bills older than
    `max_age_s` were shipped unless costd was down that long as well.
    """

    def __init__(self, max_records: int = 100_000, max_age_s: float = 900.0) -> None:
        self.max_records, self.max_age_s = max_records, max_age_s
        self._bills: OrderedDict[str, tuple[float, dict[str, str]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._bills)

    def remember(self, request_id: str, fields: dict[str, str]) -> None:
        self._bills[request_id] = (time.monotonic(), fields)
        self._bills.move_to_end(request_id)
        self._expire()

    def _expire(self) -> None:
        oldest_kept = time.monotonic() - self.max_age_s
        while self._bills and (len(self._bills) > self.max_records
                               or next(iter(self._bills.values()))[0] < oldest_kept):
            self._bills.popitem(last=False)

    async def replay(self, redis: aioredis.Redis) -> int:
        """Writes every remembered bill to the billing stream again; returns how many."""
        self._expire()
        bills = [fields for _, fields in self._bills.values()]
        for start in range(0, len(bills), _PAGE):
            async with redis.pipeline(transaction=False) as pipe:
                for fields in bills[start:start + _PAGE]:
                    pipe.xadd(BILLING_STREAM, fields)
                await pipe.execute()
        if bills:
            log.warning("wrote %d recent bills again (Redis lost its data; the ledger keeps "
                        "one per request)", len(bills))
        return len(bills)


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


@dataclass(frozen=True, slots=True)
class BillingRecord:
    """One record of the stream, as the reconciler compares it with the ledger."""

    entry_id: str
    request_id: str
    tenant_id: str
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_completion_tokens: int
    shipped: bool    # a shipper acknowledged it: costd answered its export
    fields: dict[str, str] = field(repr=False)   # the entry as written, to ship it again

    @property
    def unix_ms(self) -> int:
        return _entry_key(self.entry_id)[0]


def _entry_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def _shipper_group(redis: aioredis.Redis) -> dict | None:
    try:
        groups = await redis.xinfo_groups(BILLING_STREAM)
    except ResponseError:    # no stream yet
        return None
    return next((g for g in groups if g["name"] == SHIPPER_GROUP), None)


async def _unshipped(redis: aioredis.Redis, since_id: str) -> tuple[tuple[int, int], set[str]]:
    """(the group's last delivered id, ids from `since_id` on still pending in it)."""
    group = await _shipper_group(redis)
    if group is None:
        return (0, 0), set()
    pending: set[str] = set()
    start = since_id
    while group["pending"]:
        page = await redis.xpending_range(BILLING_STREAM, SHIPPER_GROUP, min=start, max="+",
                                          count=_PAGE)
        pending.update(p["message_id"] for p in page)
        if len(page) < _PAGE:
            break
        start = f"({page[-1]['message_id']}"
    return _entry_key(group["last-delivered-id"]), pending


def _decode(entry_id: str, fields: dict[str, str], shipped: bool) -> BillingRecord:
    attributes = json.loads(fields["d"])["attributes"]
    return BillingRecord(
        entry_id, str(attributes[vocab.REQUEST_ID]), str(attributes[vocab.TENANT_ID]),
        int(attributes[vocab.INPUT_TOKENS]), int(attributes.get(vocab.CACHE_READ_TOKENS, 0)),
        int(attributes[vocab.OUTPUT_TOKENS]), shipped, fields)


async def read_records(redis: aioredis.Redis, since_unix_ms: int) -> list[BillingRecord]:
    """Records written from `since_unix_ms` on (Redis's clock), shipped or not, oldest first.
    `redis` decodes responses. An undecodable record is logged and left out."""
    since_id = f"{max(0, since_unix_ms)}-0"
    last_delivered, pending = await _unshipped(redis, since_id)
    records: list[BillingRecord] = []
    start = since_id
    while True:
        page = await redis.xrange(BILLING_STREAM, min=start, max="+", count=_PAGE)
        for entry_id, fields in page:
            shipped = _entry_key(entry_id) <= last_delivered and entry_id not in pending
            try:
                records.append(_decode(entry_id, fields, shipped))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("billing record %s is undecodable (%r); left out", entry_id, exc)
        if len(page) < _PAGE:
            return records
        start = f"({page[-1][0]}"


async def horizon_unix_ms(redis: aioredis.Redis) -> int:
    """The time before which the stream may have dropped records (trimmed after shipping, or
    deleted by an older shipper); every record written after it is still there. 0: nothing
    was ever dropped (or the stream is gone: Redis lost its data)."""
    try:
        info = await redis.xinfo_stream(BILLING_STREAM)
    except ResponseError:
        return 0
    dropped = [_entry_key(info["max-deleted-entry-id"])]
    if int(info["entries-added"]) > int(info["length"]):   # trimmed from the front
        first = info["recorded-first-entry-id"] if info["length"] else info["last-generated-id"]
        dropped.append(_entry_key(first))
    return max(dropped)[0]


async def trim_shipped(redis: aioredis.Redis, retention_s: float = RETENTION_S) -> int:
    """Drops records older than `retention_s` (Redis's clock) that a shipper acknowledged;
    never one that waits to be shipped. Returns how many went."""
    seconds, micros = await redis.time()
    cut = (int(seconds) * 1000 + int(micros) // 1000 - int(retention_s * 1000), 0)
    group = await _shipper_group(redis)
    if group is None or cut[0] <= 0:
        return 0
    # Nothing the group has not delivered yet, nor anything still pending in it.
    last_ms, last_seq = _entry_key(group["last-delivered-id"])
    cut = min(cut, (last_ms, last_seq + 1))
    if group["pending"]:
        cut = min(cut, _entry_key((await redis.xpending(BILLING_STREAM, SHIPPER_GROUP))["min"]))
    return await redis.xtrim(BILLING_STREAM, minid=f"{cut[0]}-{cut[1]}", approximate=False)
