"""Worker capacity reports: one `llmmesh.capacity` span per worker per interval of uptime.

A worker emits one span per interval (start and end are the interval's), flagged
`llmmesh.capacity.final == true` and keyed by `llmmesh.capacity.interval.id`, so retried
exports land once. The intervals of one worker are contiguous: their sum is its uptime, the
device-hours the fleet paid for, against which attributed request time is reconciled.
`llmmesh.capacity.loading_s` says how much of the interval the worker spent loading models:
capacity of its own category (`loading`), neither a request's time nor idle.
"""
from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from costd.attributes import MalformedUsage, SpanAttributes, seconds_to_ns
from llmmesh import vocab

FINAL = vocab.CAPACITY_FINAL
# Workers report every few seconds; a longer interval is a broken sender, and the bound lets
# range queries use the start-time index alone.
MAX_INTERVAL_NS = 24 * 3600 * 1_000_000_000
# Loading seconds arrive as a double: a whole interval's may round a few ns past its end.
_FLOAT_SLACK_NS = 1_000


@dataclass(frozen=True, slots=True)
class CapacityRecord:
    """One interval of one worker's uptime, exactly as written to the ledger."""

    interval_id: str
    worker_id: str
    device_type: str
    start_unix_ns: int
    end_unix_ns: int
    loading_ns: int = 0   # of the interval, spent loading models

    def __post_init__(self) -> None:
        for name in ("interval_id", "worker_id", "device_type"):
            if not getattr(self, name):
                raise MalformedUsage(f"{name} is empty")
        if self.start_unix_ns <= 0:
            raise MalformedUsage("capacity span has no start time")
        if self.end_unix_ns < self.start_unix_ns:
            raise MalformedUsage(
                f"capacity interval ends ({self.end_unix_ns}) before it starts "
                f"({self.start_unix_ns})")
        if self.duration_ns > MAX_INTERVAL_NS:
            raise MalformedUsage(f"capacity interval is longer than a day ({self.duration_ns} ns)")
        if not 0 <= self.loading_ns <= self.duration_ns:
            raise MalformedUsage(
                f"{vocab.CAPACITY_LOADING_S} must be between 0 and the interval's "
                f"{self.duration_ns / 1e9:.9f} s, got {self.loading_ns / 1e9:.9f} s")

    @property
    def duration_ns(self) -> int:
        return self.end_unix_ns - self.start_unix_ns


def capacity_from_span(span: Span) -> CapacityRecord | None:
    """The span's capacity record; None when the span is not a final capacity report."""
    attrs = SpanAttributes(span)
    if FINAL not in attrs or not attrs.flag(FINAL):
        return None
    if span.end_time_unix_nano == 0:
        raise MalformedUsage("span has no end time")
    loading_ns = seconds_to_ns(attrs.seconds(vocab.CAPACITY_LOADING_S, 0.0))
    duration_ns = span.end_time_unix_nano - span.start_time_unix_nano
    if duration_ns < loading_ns <= duration_ns + _FLOAT_SLACK_NS:
        loading_ns = duration_ns   # the whole interval, sent as float seconds
    return CapacityRecord(
        interval_id=attrs.text(vocab.CAPACITY_INTERVAL_ID),
        worker_id=attrs.text(vocab.WORKER_ID),
        device_type=attrs.text(vocab.DEVICE_TYPE),
        start_unix_ns=span.start_time_unix_nano,
        end_unix_ns=span.end_time_unix_nano,
        # A worker that loads nothing (or predates the attribute) sends none.
        loading_ns=loading_ns,
    )
