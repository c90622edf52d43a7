"""The per-worker circuit breaker, on a fake clock: opens after 3 consecutive failures, lets
one probe through after the cool-down, closes on its success, reopens on its failure."""
from __future__ import annotations

from router.breaker import CircuitBreaker, CircuitState
from router.registry import WorkerHandle


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_opens_after_consecutive_failures_and_a_success_resets_the_count():
    b = CircuitBreaker("w", failure_threshold=3, open_s=5, clock=Clock())
    b.on_failure(), b.on_failure(), b.on_success(), b.on_failure(), b.on_failure()
    assert b.state is CircuitState.CLOSED and b.available()     # never 3 in a row
    b.on_failure()
    assert b.state is CircuitState.OPEN and not b.available()


def test_one_probe_after_the_cool_down_closes_or_reopens():
    clock = Clock()
    b = CircuitBreaker("w", failure_threshold=1, open_s=5, clock=clock)
    b.on_failure()
    clock.now += 4.9
    assert not b.available()
    clock.now += 0.2
    assert b.available()
    b.on_dispatch()
    assert b.state is CircuitState.HALF_OPEN and not b.available()   # one probe at a time
    b.on_failure()
    assert b.state is CircuitState.OPEN and not b.available()        # cool-down starts again
    clock.now += 5.1
    b.on_dispatch()
    b.on_success()
    assert b.state is CircuitState.CLOSED and b.available()


def test_an_open_circuit_leaves_a_worker_no_free_slots():
    h = WorkerHandle(worker_id="w", address="", max_inflight=4, channel=None, stub=None,
                     breaker=CircuitBreaker("w", failure_threshold=1, clock=Clock()))
    assert h.free_slots == 4
    h.breaker.on_failure()
    assert h.free_slots == 0
    h.healthy = True          # a lease refresh does not close it
    assert h.free_slots == 0
