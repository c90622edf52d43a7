"""Typed, strict reads of OTLP span attributes, shared by every span costd bills from."""
from __future__ import annotations

import math
from decimal import ROUND_HALF_EVEN, Decimal

from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from costd.pipeline import PermanentError


def seconds_to_ns(seconds: float) -> int:
    """Exact (via Decimal) so the ledger's integer sums never depend on float rounding order."""
    return int(Decimal(seconds).scaleb(9).to_integral_value(ROUND_HALF_EVEN))


class MalformedUsage(PermanentError):
    """A billing span (usage or capacity) that cannot be billed as sent; resending cannot help."""


class SpanAttributes:
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
