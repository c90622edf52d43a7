"""The usage processor: turns billing spans into a `LedgerBatch` for the ledger.

Billing reads only spans flagged `llmmesh.usage.final == true` (the router's request span,
set once per request when it has ended), never the per-attempt `gen_ai.generate` spans, so a
retried attempt can never be billed twice; and the workers' `llmmesh.capacity` reports
(costd.capacity), from which idle capacity is known.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from costd.attributes import MalformedUsage, SpanAttributes, seconds_to_ns
from costd.capacity import CapacityRecord, capacity_from_span
from costd.pipeline import Consumer, Rejection
from llmmesh import vocab

FINAL = vocab.USAGE_FINAL


__all__ = ["LedgerBatch", "MalformedUsage", "UsageProcessor", "UsageRecord", "record_from_span"]


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One request's usage, exactly as it is written to the ledger (keyed by `request_id`)."""

    request_id: str
    tenant_id: str
    model: str
    request_class: str
    num_prompt_tokens: int  # cached included, as in gen_ai.usage.input_tokens
    num_cached_prompt_tokens: int
    num_completion_tokens: int
    prefill_device_s: float
    decode_device_s: float
    device_type: str
    worker_id: str
    finish_reasons: tuple[str, ...]
    end_unix_ns: int

    def __post_init__(self) -> None:
        for name in ("request_id", "tenant_id"):
            if not getattr(self, name):
                raise MalformedUsage(f"{name} is empty")
        for name in ("num_prompt_tokens", "num_cached_prompt_tokens", "num_completion_tokens",
                     "end_unix_ns"):
            if getattr(self, name) < 0:
                raise MalformedUsage(f"{name} is negative ({getattr(self, name)})")
        for name in ("prefill_device_s", "decode_device_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise MalformedUsage(f"{name} must be finite and >= 0, got {value}")
        if self.num_cached_prompt_tokens > self.num_prompt_tokens:
            raise MalformedUsage(
                f"cached prompt tokens ({self.num_cached_prompt_tokens}) exceed prompt tokens "
                f"({self.num_prompt_tokens}); input_tokens must include cached ones")

    @property
    def prefill_device_ns(self) -> int:
        return seconds_to_ns(self.prefill_device_s)

    @property
    def decode_device_ns(self) -> int:
        return seconds_to_ns(self.decode_device_s)


@dataclass(frozen=True, slots=True)
class LedgerBatch:
    """What one export carries into the ledger: request usage and worker capacity intervals."""

    usage: tuple[UsageRecord, ...] = ()
    capacity: tuple[CapacityRecord, ...] = field(default=())

    def __bool__(self) -> bool:
        return bool(self.usage or self.capacity)


def record_from_span(span: Span) -> UsageRecord | None:
    """The span's usage record; None when the span is not a final usage span."""
    attrs = SpanAttributes(span)
    if FINAL not in attrs or not attrs.flag(FINAL):
        return None
    if span.end_time_unix_nano == 0:
        raise MalformedUsage("span has no end time")
    # Token counts have no default: a missing count would silently under-bill.
    return UsageRecord(
        request_id=attrs.text(vocab.REQUEST_ID),
        tenant_id=attrs.text(vocab.TENANT_ID),
        model=attrs.text(vocab.REQUEST_MODEL, ""),
        request_class=attrs.text(vocab.REQUEST_CLASS, ""),
        num_prompt_tokens=attrs.count(vocab.INPUT_TOKENS),
        num_cached_prompt_tokens=attrs.count(vocab.CACHE_READ_TOKENS, 0),
        num_completion_tokens=attrs.count(vocab.OUTPUT_TOKENS),
        # A request that never reached a worker has used no device time.
        prefill_device_s=attrs.seconds(vocab.PREFILL_DEVICE_S, 0.0),
        decode_device_s=attrs.seconds(vocab.DECODE_DEVICE_S, 0.0),
        device_type=attrs.text(vocab.DEVICE_TYPE, ""),
        worker_id=attrs.text(vocab.WORKER_ID, ""),
        finish_reasons=attrs.texts(vocab.FINISH_REASONS),
        end_unix_ns=span.end_time_unix_nano,
    )


def _span_label(span: Span) -> str:
    label = f"span {span.span_id.hex() or '<no id>'}"
    keys = {vocab.REQUEST_ID: "request", vocab.CAPACITY_INTERVAL_ID: "interval"}
    for kv in span.attributes:
        if kv.key in keys and kv.value.string_value:
            return f"{label} ({keys[kv.key]} {kv.value.string_value})"
    return label


class UsageProcessor:
    """Spans in, one `LedgerBatch` out to the next stage; malformed spans become rejections."""

    def __init__(self, next_consumer: Consumer[LedgerBatch]) -> None:
        self._next = next_consumer

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    async def consume(self, batch: Sequence[Span]) -> Sequence[Rejection]:
        usage: list[UsageRecord] = []
        capacity: list[CapacityRecord] = []
        rejections: list[Rejection] = []
        for span in batch:
            try:
                record = record_from_span(span) or capacity_from_span(span)
            except MalformedUsage as error:
                rejections.append(Rejection(_span_label(span), str(error)))
                continue
            if isinstance(record, UsageRecord):
                usage.append(record)
            elif record is not None:
                capacity.append(record)
        ledger_batch = LedgerBatch(tuple(usage), tuple(capacity))
        if ledger_batch:
            rejections.extend(await self._next.consume(ledger_batch))
        return rejections
