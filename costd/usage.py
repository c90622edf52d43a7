"""The usage processor: turns the one final usage span of each request into a `UsageRecord`.

Billing reads only spans flagged `llmmesh.usage.final == true` (the router's request span,
set once per request when it has ended), never the per-attempt `gen_ai.generate` spans, so a
retried attempt can never be billed twice.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from costd.pipeline import Consumer, PermanentError, Rejection

FINAL = "llmmesh.usage.final"
REQUEST_ID = "llmmesh.request.id"
TENANT_ID = "llmmesh.tenant.id"
MODEL = "gen_ai.request.model"
REQUEST_CLASS = "llmmesh.request.class"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHED_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
PREFILL_DEVICE_S = "llmmesh.prefill.device_seconds"
DECODE_DEVICE_S = "llmmesh.decode.device_seconds"
DEVICE_TYPE = "llmmesh.device.type"
WORKER_ID = "llmmesh.worker.id"
FINISH_REASONS = "gen_ai.response.finish_reasons"


class MalformedUsage(PermanentError):
    """A final usage span that cannot be billed as sent; resending it cannot help."""


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


class _Attributes:
    """Typed, strict reads of a span's attributes; every failure names the attribute."""

    def __init__(self, span: Span) -> None:
        self._values: dict[str, AnyValue] = {kv.key: kv.value for kv in span.attributes}

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def _get(self, key: str, kind: str, default: object) -> object:
        value = self._values.get(key)
        if value is None or value.WhichOneof("value") is None:
            if default is None:
                raise MalformedUsage(f"{key} is required")
            return default
        if value.WhichOneof("value") != kind:
            raise MalformedUsage(f"{key} must be {kind}, got {value.WhichOneof('value')}")
        return getattr(value, kind)

    def text(self, key: str, default: str | None = None) -> str:
        value = self._get(key, "string_value", default)
        if default is None and not value:
            raise MalformedUsage(f"{key} is required")
        return value  # type: ignore[return-value]

    def flag(self, key: str) -> bool:
        return self._get(key, "bool_value", False)  # type: ignore[return-value]

    def count(self, key: str, default: int | None = None) -> int:
        value = self._values.get(key)
        # Some SDKs send counts as doubles; accept them only when nothing would be rounded.
        if value is not None and value.WhichOneof("value") == "double_value":
            if not value.double_value.is_integer():
                raise MalformedUsage(f"{key} must be an integer, got {value.double_value}")
            number = int(value.double_value)
        else:
            number = self._get(key, "int_value", default)  # type: ignore[assignment]
        if number < 0:
            raise MalformedUsage(f"{key} must be >= 0, got {number}")
        return number

    def seconds(self, key: str, default: float) -> float:
        value = self._values.get(key)
        if value is not None and value.WhichOneof("value") == "int_value":
            number = float(value.int_value)
        else:
            number = self._get(key, "double_value", default)  # type: ignore[assignment]
        if not math.isfinite(number) or number < 0:
            raise MalformedUsage(f"{key} must be finite and >= 0, got {number}")
        return number

    def texts(self, key: str) -> tuple[str, ...]:
        array = self._get(key, "array_value", ())
        if not array:
            return ()
        if any(v.WhichOneof("value") != "string_value" for v in array.values):
            raise MalformedUsage(f"{key} must be an array of strings")
        return tuple(v.string_value for v in array.values)


def record_from_span(span: Span) -> UsageRecord | None:
    """The span's usage record; None when the span is not a final usage span."""
    attrs = _Attributes(span)
    if FINAL not in attrs or not attrs.flag(FINAL):
        return None
    if span.end_time_unix_nano == 0:
        raise MalformedUsage("span has no end time")
    # Token counts have no default: a missing count would silently under-bill.
    return UsageRecord(
        request_id=attrs.text(REQUEST_ID),
        tenant_id=attrs.text(TENANT_ID),
        model=attrs.text(MODEL, ""),
        request_class=attrs.text(REQUEST_CLASS, ""),
        num_prompt_tokens=attrs.count(INPUT_TOKENS),
        num_cached_prompt_tokens=attrs.count(CACHED_INPUT_TOKENS, 0),
        num_completion_tokens=attrs.count(OUTPUT_TOKENS),
        # A request that never reached a worker has used no device time.
        prefill_device_s=attrs.seconds(PREFILL_DEVICE_S, 0.0),
        decode_device_s=attrs.seconds(DECODE_DEVICE_S, 0.0),
        device_type=attrs.text(DEVICE_TYPE, ""),
        worker_id=attrs.text(WORKER_ID, ""),
        finish_reasons=attrs.texts(FINISH_REASONS),
        end_unix_ns=span.end_time_unix_nano,
    )


def _span_label(span: Span) -> str:
    label = f"span {span.span_id.hex() or '<no id>'}"
    request_ids = [kv.value.string_value for kv in span.attributes if kv.key == REQUEST_ID]
    return f"{label} (request {request_ids[0]})" if request_ids and request_ids[0] else label


class UsageProcessor:
    """Spans in, usage records out to the next stage; malformed spans become rejections."""

    def __init__(self, next_consumer: Consumer[Sequence[UsageRecord]]) -> None:
        self._next = next_consumer

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    async def consume(self, batch: Sequence[Span]) -> Sequence[Rejection]:
        records: list[UsageRecord] = []
        rejections: list[Rejection] = []
        for span in batch:
            try:
                record = record_from_span(span)
            except MalformedUsage as error:
                rejections.append(Rejection(_span_label(span), str(error)))
                continue
            if record is not None:
                records.append(record)
        if records:
            rejections.extend(await self._next.consume(records))
        return rejections
