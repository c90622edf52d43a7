"""Worker capacity reports: contiguous intervals, unique ids, a final partial one on shutdown."""
from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from workers.capacity import report_capacity


def tracer_and_spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_intervals_are_contiguous_and_the_last_partial_one_is_sent_on_cancel():
    tracer, exporter = tracer_and_spans()

    async def run() -> None:
        task = asyncio.create_task(report_capacity(tracer, "w7", "cpu", interval_s=0.02))
        while len(exporter.get_finished_spans()) < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    spans = exporter.get_finished_spans()
    assert len(spans) >= 4  # three full intervals and the final partial one
    for before, after in zip(spans, spans[1:]):
        assert after.start_time == before.end_time  # no gap, no overlap: uptime counted once
    ids = [s.attributes["llmmesh.capacity.interval.id"] for s in spans]
    assert len(set(ids)) == len(ids) and ids[0] == f"w7:{spans[0].start_time}"
    assert all(s.name == "llmmesh.capacity" and s.attributes["llmmesh.capacity.final"] is True
               and s.attributes["llmmesh.device.type"] == "cpu" for s in spans)


def test_bad_interval_is_refused():
    tracer, _ = tracer_and_spans()
    with pytest.raises(ValueError):
        asyncio.run(report_capacity(tracer, "w", "cpu", interval_s=0))
