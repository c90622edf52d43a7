"""The interactive wait bound (llmmesh.drain): what routers report, how gateways sum it, and the
bound the gateway's admission passes to its enqueue script."""
from __future__ import annotations

import json
import time

import pytest

from gateway.frontend import Frontend, FrontendConfig
from llmmesh import drain
from llmmesh.drain import ClassDrain, DrainMeter, DrainView, WorkerSeats


def test_a_meter_counts_ends_per_class_over_its_window(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(drain.time, "monotonic", lambda: now[0])
    meter = DrainMeter("r1")
    for _ in range(6):
        meter.ended("interactive")
    meter.ended("batch")
    assert meter.rates() == {"interactive": 6 / drain.WINDOW_S, "batch": 1 / drain.WINDOW_S}
    now[0] += drain.WINDOW_S + 0.01
    assert meter.rates() == {"interactive": 0.0, "batch": 0.0}


def _view(reports: dict[str, str], now: float | None = None):
    view = DrainView(None)
    for router, report in reports.items():
        view.take(router, report, now=now)
    return view


def test_reports_are_summed_and_malformed_ones_left_out(monkeypatch):
    monkeypatch.setattr(drain.time, "monotonic", lambda: 100.0)
    a, b = DrainMeter("a"), DrainMeter("b")
    a.ended("interactive")
    # Two routers share w1 (16 seats, 20 requests each may send): 10 + 8 requests on it, 14 of
    # them interactive; w2 (4 seats) runs 1 batch request for router a.
    view = _view({"a": a.report({"interactive": 10, "batch": 1},
                                {"w1": WorkerSeats(16, 20, 10, 6), "w2": WorkerSeats(4, 5, 1, 0)}),
                  "b": b.report({"interactive": 8}, {"w1": WorkerSeats(16, 20, 8, 8)}),
                  "bad": "{not json", "odd": '{"workers": 3}', "huge": '{"workers": {"w": [1e400, 1, 1, 1]}}'})
    # Interactive: w1 has 2 seats not held by interactive work (batch ones it would preempt),
    # w2 has 4; the routers may still send 10 + 4 + 12 = 26.
    assert view.current("interactive") == ClassDrain(running=18, ended_per_s=1 / drain.WINDOW_S,
                                                     free_slots=6)
    # Batch needs a seat nobody holds: w1 is 2 over (2 wait inside it), w2 has 3.
    assert view.current("batch") == ClassDrain(running=1, ended_per_s=0.0, free_slots=1)


def test_a_report_unchanged_for_long_drops_out_and_none_left_means_no_bound(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(drain.time, "monotonic", lambda: now[0])
    meter = DrainMeter("a")
    stopped = meter.report({"interactive": 2}, {"w1": WorkerSeats(16, 20, 2, 2)})
    view = _view({"a": stopped}, now=now[0])
    assert view.current("interactive") is not None
    now[0] += drain.FRESH_S / 2
    view.take("a", stopped)               # read again from the hash: the same text
    now[0] += drain.FRESH_S / 2 + 0.01
    assert view.current("interactive") is None
    view.take("a", meter.report({"interactive": 2}, {"w1": WorkerSeats(16, 20, 2, 2)}))
    assert view.current("interactive") is not None   # a live router's next report differs


def test_free_is_what_the_routers_may_still_send_when_that_is_less():
    report = DrainMeter("a").report({"interactive": 2, "batch": 18},
                                    {"w1": WorkerSeats(16, 20, 20, 2)})
    assert _view({"a": report}).current("interactive").free_slots == 0   # no router slot


def test_the_bound_admits_what_free_seats_and_the_slo_can_absorb():
    d = ClassDrain(running=16, ended_per_s=40.0, free_slots=0)
    assert d.bound(0.1) == 16 + 4           # 4 more drain within 100 ms
    queued = ClassDrain(running=20, ended_per_s=40.0, free_slots=-4)
    assert queued.bound(0.1) == 20          # 4 wait inside the engine: no more fit in 100 ms
    idle = ClassDrain(running=0, ended_per_s=0.0, free_slots=16)
    assert idle.bound(0.1) == 16            # no rate known yet: the free seats still admit


class _View:
    def __init__(self, current):
        self._current = current

    def current(self, request_class):
        return self._current


@pytest.mark.parametrize("max_wait_s,cls,current,expected", [
    (0.0, "interactive", ClassDrain(16, 40.0, 0), (64, False)),    # no SLO: the entry bound
    (0.1, "batch", ClassDrain(16, 40.0, 0), (64, False)),          # batch: the entry bound
    (0.1, "interactive", None, (64, False)),                        # no router reports
    (0.1, "interactive", ClassDrain(16, 40.0, 0), (20, True)),
    (0.1, "interactive", ClassDrain(60, 400.0, 8), (64, False)),    # the entry bound is lower
    (0.1, "interactive", ClassDrain(0, 0.0, 0), (1, True)),         # never below one
])
def test_the_gateway_passes_the_lower_of_the_two_bounds(max_wait_s, cls, current, expected):
    import redis.asyncio as aioredis
    frontend = Frontend(aioredis.Redis(), tracer=None, config=FrontendConfig(
        max_queue_len=64, interactive_max_wait_s=max_wait_s))   # never connects
    frontend.drain = _View(current)
    assert frontend._queue_bound(cls) == expected


def test_seats_interactive_may_take_from_batch_count_as_free_past_the_slot_cap():
    """Every router slot taken (16 batch, 4 interactive on w1): interactive can still start at
    once in a seat batch holds while interactive holds fewer than the 12 it may take there;
    not once it holds them, and a router without the field (4 values) counts none."""
    meter = DrainMeter("a")
    full = meter.report({"interactive": 4, "batch": 16}, {"w1": WorkerSeats(16, 20, 20, 4, 12)})
    assert _view({"a": full}).current("interactive").free_slots == 8
    taken = meter.report({"interactive": 12, "batch": 16}, {"w1": WorkerSeats(16, 20, 28, 12, 12)})
    assert _view({"a": taken}).current("interactive").free_slots == 0
    waiting = meter.report({"interactive": 20}, {"w1": WorkerSeats(16, 20, 20, 20, 12)})
    assert _view({"a": waiting}).current("interactive").free_slots == -4   # waits in the engine
    old = meter.report({"interactive": 4, "batch": 16}, {"w1": WorkerSeats(16, 20, 20, 4)})
    assert _view({"a": old}).current("interactive").free_slots == 0
    assert _view({"a": full}).current("batch").free_slots == -4   # batch borrows nothing
