"""Usage processor: only final usage and capacity spans become records; malformed ones become rejections."""
from __future__ import annotations

import asyncio

import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from costd.capacity import CapacityRecord, capacity_from_span
from costd.usage import MalformedUsage, UsageProcessor, UsageRecord, record_from_span

END_NS = 1_700_000_000 * 1_000_000_000


def any_value(value) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, (list, tuple)):
        return AnyValue(array_value=ArrayValue(values=[any_value(v) for v in value]))
    return AnyValue(string_value=value)


def usage_attributes(**overrides) -> dict:
    attributes = {
        "llmmesh.usage.final": True, "llmmesh.request.id": "req-1",
        "llmmesh.tenant.id": "acme", "gen_ai.request.model": "smollm2-135m-instruct",
        "llmmesh.request.class": "batch", "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 5, "gen_ai.usage.cache_read.input_tokens": 8,
        "llmmesh.prefill.device_seconds": 0.125, "llmmesh.decode.device_seconds": 0.5,
        "llmmesh.device.type": "cuda", "llmmesh.worker.id": "w3",
        "gen_ai.response.finish_reasons": ["length"],
    }
    attributes.update(overrides)
    return {k: v for k, v in attributes.items() if v is not None}


def span(attributes: dict, span_id: bytes = b"\x01" * 8, end_ns: int = END_NS) -> Span:
    return Span(name="llmmesh.request", span_id=span_id, end_time_unix_nano=end_ns,
                attributes=[KeyValue(key=k, value=any_value(v)) for k, v in attributes.items()])


def test_final_span_becomes_a_record():
    assert record_from_span(span(usage_attributes())) == UsageRecord(
        request_id="req-1", tenant_id="acme", model="smollm2-135m-instruct",
        request_class="batch", num_prompt_tokens=12, num_cached_prompt_tokens=8,
        num_completion_tokens=5, prefill_device_s=0.125, decode_device_s=0.5,
        device_type="cuda", worker_id="w3", finish_reasons=("length",), end_unix_ns=END_NS)


@pytest.mark.parametrize("final", [None, False])
def test_span_without_the_final_flag_is_ignored(final):
    # Same usage attributes as a billable span: only the flag keeps it off the bill.
    assert record_from_span(span(usage_attributes(**{"llmmesh.usage.final": final}))) is None


def test_optional_attributes_default_to_neutral_values():
    attrs = usage_attributes(**{k: None for k in (
        "gen_ai.usage.cache_read.input_tokens", "llmmesh.prefill.device_seconds",
        "llmmesh.decode.device_seconds", "gen_ai.response.finish_reasons")})
    got = record_from_span(span(attrs))
    assert (got.num_cached_prompt_tokens, got.prefill_device_s, got.finish_reasons) == (0, 0.0, ())


def test_integral_double_counts_are_accepted():
    attrs = usage_attributes(**{"gen_ai.usage.output_tokens": 5.0})
    assert record_from_span(span(attrs)).num_completion_tokens == 5


@pytest.mark.parametrize("overrides, reason", [
    ({"llmmesh.tenant.id": None}, "llmmesh.tenant.id is required"),
    ({"llmmesh.tenant.id": ""}, "llmmesh.tenant.id is required"),
    ({"llmmesh.request.id": None}, "llmmesh.request.id is required"),
    ({"gen_ai.usage.output_tokens": -1}, "gen_ai.usage.output_tokens must be >= 0"),
    ({"gen_ai.usage.input_tokens": None}, "gen_ai.usage.input_tokens is required"),
    ({"gen_ai.usage.input_tokens": "12"}, "gen_ai.usage.input_tokens must be int_value"),
    ({"gen_ai.usage.output_tokens": 2.5}, "must be an integer"),
    ({"llmmesh.decode.device_seconds": -0.1}, "llmmesh.decode.device_seconds must be finite"),
    ({"gen_ai.usage.cache_read.input_tokens": 13}, "exceed prompt tokens"),
    ({"llmmesh.usage.final": "true"}, "llmmesh.usage.final must be bool_value"),
])
def test_malformed_final_span_names_the_attribute(overrides, reason):
    with pytest.raises(MalformedUsage, match=reason):
        record_from_span(span(usage_attributes(**overrides)))


def test_final_span_without_end_time_is_malformed():
    with pytest.raises(MalformedUsage, match="end time"):
        record_from_span(span(usage_attributes(), end_ns=0))


class Collect:
    def __init__(self) -> None:
        self.batches: list = []

    async def consume(self, batch):
        self.batches.append(batch)
        return ()


def test_processor_passes_good_records_and_rejects_bad_spans():
    sink = Collect()
    batch = [
        span(usage_attributes(**{"llmmesh.request.id": "good"})),
        span(usage_attributes(**{"llmmesh.tenant.id": None, "llmmesh.request.id": "bad"}),
             span_id=bytes.fromhex("00000000000000ab")),
        span({"gen_ai.usage.input_tokens": 99}),  # a worker span: ignored, not rejected
    ]
    rejections = asyncio.run(UsageProcessor(sink).consume(batch))
    assert [r.request_id for r in sink.batches[0].usage] == ["good"]
    assert [str(r) for r in rejections] == [
        "span 00000000000000ab (request bad): llmmesh.tenant.id is required"]


def test_processor_sends_nothing_downstream_when_no_span_bills():
    sink = Collect()
    assert asyncio.run(UsageProcessor(sink).consume([span({"x": 1})])) == []
    assert sink.batches == []


def capacity_span(interval_id="w1:100", start_ns=END_NS - 10 * 10**9, end_ns=END_NS,
                  **overrides) -> Span:
    attributes = {"llmmesh.capacity.final": True, "llmmesh.capacity.interval.id": interval_id,
                  "llmmesh.worker.id": "w1", "llmmesh.device.type": "cpu", **overrides}
    attributes = {k: v for k, v in attributes.items() if v is not None}
    return Span(name="llmmesh.capacity", span_id=b"\x02" * 8, start_time_unix_nano=start_ns,
                end_time_unix_nano=end_ns,
                attributes=[KeyValue(key=k, value=any_value(v)) for k, v in attributes.items()])


def test_capacity_span_becomes_a_capacity_record_next_to_usage():
    sink = Collect()
    batch = [span(usage_attributes()), capacity_span()]
    assert asyncio.run(UsageProcessor(sink).consume(batch)) == []
    (ledger_batch,) = sink.batches
    assert [r.request_id for r in ledger_batch.usage] == ["req-1"]
    assert ledger_batch.capacity == (CapacityRecord("w1:100", "w1", "cpu", END_NS - 10**10, END_NS),)


@pytest.mark.parametrize("span_, reason", [
    (capacity_span(**{"llmmesh.capacity.interval.id": None}),
     "llmmesh.capacity.interval.id is required"),
    (capacity_span(**{"llmmesh.device.type": None}), "llmmesh.device.type is required"),
    (capacity_span(start_ns=END_NS + 1), "ends (1700000000000000000) before it starts"),
    (capacity_span(start_ns=END_NS - 25 * 3600 * 10**9), "longer than a day"),
])
def test_malformed_capacity_span_is_rejected_with_its_interval(span_, reason):
    sink = Collect()
    (rejection,) = asyncio.run(UsageProcessor(sink).consume([span_]))
    assert reason in rejection.reason
    assert sink.batches == []


def test_capacity_span_without_the_final_flag_is_ignored():
    assert capacity_from_span(capacity_span(**{"llmmesh.capacity.final": False})) is None


def test_device_seconds_become_exact_nanoseconds():
    record = record_from_span(span(usage_attributes(**{
        "llmmesh.prefill.device_seconds": 0.1, "llmmesh.decode.device_seconds": 1e-10})))
    # 0.1 as a double is 0.1000000000000000055…: rounding to ns gives exactly 100 ms.
    assert (record.prefill_device_ns, record.decode_device_ns) == (100_000_000, 0)


def test_loading_seconds_become_the_interval_s_loading_nanoseconds():
    record = capacity_from_span(capacity_span(**{"llmmesh.capacity.loading_s": 2.5}))
    assert (record.duration_ns, record.loading_ns) == (10 * 10**9, 2_500_000_000)
    # A worker that loads nothing (or predates the attribute) sends none: 0, not an error.
    assert capacity_from_span(capacity_span()).loading_ns == 0
    # A whole interval spent loading, sent as float seconds, is the whole interval.
    whole = capacity_from_span(capacity_span(start_ns=END_NS - 10**10 - 7, **{
        "llmmesh.capacity.loading_s": (10**10 + 7) / 1e9}))
    assert whole.loading_ns == whole.duration_ns


@pytest.mark.parametrize("loading_s, reason", [
    (10.5, "llmmesh.capacity.loading_s must be between 0 and the interval's 10.000000000 s"),
    (-1.0, "llmmesh.capacity.loading_s must be finite and >= 0"),
])
def test_loading_beyond_the_interval_or_negative_is_rejected(loading_s, reason):
    sink = Collect()
    (rejection,) = asyncio.run(UsageProcessor(sink).consume([capacity_span(**{
        "llmmesh.capacity.loading_s": loading_s})]))
    assert reason in rejection.reason and "interval w1:100" in rejection.item_id
    assert sink.batches == []
