"""Capacity reports: one `llmmesh.capacity` span per interval of this worker's uptime.

costd bills idle capacity as uptime minus the device time attributed to requests, so every
second the worker is up must be in exactly one report: intervals are contiguous (each starts
where the last ended), the last partial one is sent on shutdown, and each carries a unique
interval id so a retried export is counted once.
"""
from __future__ import annotations

import asyncio
import time

from opentelemetry import trace

from llmmesh import vocab


def emit_interval(tracer: trace.Tracer, worker_id: str, device_type: str, start_ns: int,
                  end_ns: int, loading_s: float = 0.0) -> None:
    span = tracer.start_span(vocab.CAPACITY_SPAN, start_time=start_ns, attributes={
        vocab.WORKER_ID: worker_id, vocab.DEVICE_TYPE: device_type,
        vocab.CAPACITY_FINAL: True,
        vocab.CAPACITY_INTERVAL_ID: f"{worker_id}:{start_ns}",
        # Seconds of the interval spent loading models (their own capacity category).
        vocab.CAPACITY_LOADING_S: min(loading_s, max(0.0, (end_ns - start_ns) / 1e9))})
    span.end(end_time=end_ns)


async def report_capacity(tracer: trace.Tracer, worker_id: str, device_type: str,
                          interval_s: float = 10.0, loading=None) -> None:
    """Runs until cancelled; cancelling it reports the final partial interval, then re-raises.
    `loading()`: seconds spent loading models since its last call (None: no loading)."""
    take = loading or (lambda: 0.0)
    if interval_s <= 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    start_ns = time.time_ns()
    # Sleep on the monotonic clock towards fixed deadlines, so intervals do not drift longer.
    next_deadline = time.monotonic() + interval_s
    try:
        while True:
            await asyncio.sleep(max(0.0, next_deadline - time.monotonic()))
            next_deadline += interval_s
            end_ns = time.time_ns()
            emit_interval(tracer, worker_id, device_type, start_ns, end_ns, take())
            start_ns = end_ns
    except asyncio.CancelledError:
        emit_interval(tracer, worker_id, device_type, start_ns, max(start_ns, time.time_ns()),
                      take())
        raise
