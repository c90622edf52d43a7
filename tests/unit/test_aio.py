"""Timed waits let a cancel through, also one that lands as the awaited thing finishes: on
Python 3.11, asyncio.wait_for swallows that one (gh-86296). Checked on llmmesh.aio and on each
place that waits with it: the router's dispatch loop, a worker replacing an older attempt, a
request waiting for its model to load."""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import types

import pytest

from llmmesh.aio import wait_event, within
from workers import hosting
from workers.servicer import WorkerServicer, _Attempt


async def _cancel_as_the_event_fires(wait) -> bool:
    """A loop of timed waits, like Dispatcher.run's; True when cancel() ended it."""
    event = asyncio.Event()

    async def loop() -> None:
        while True:
            event.clear()
            await wait(event, 0.05)

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.001)
    event.set()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.5)
    if not done:            # swallowed: stop it for good (the loop sees this second cancel)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return bool(done)


async def _wait_for(event: asyncio.Event, timeout_s: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout_s)


def test_a_cancel_that_lands_as_the_event_is_set_ends_the_loop():
    async def body():
        assert all([await _cancel_as_the_event_fires(wait_event) for _ in range(20)])
    asyncio.run(body())


def test_wait_event_says_whether_the_event_came_or_the_time_ran_out():
    async def body():
        event = asyncio.Event()
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await wait_event(event, 0.05) is False       # times out quietly
        assert loop.time() - started >= 0.04
        loop.call_later(0.01, event.set)
        started = loop.time()
        assert await wait_event(event, 5.0) is True         # returns when set, not at 5 s
        assert loop.time() - started < 1.0
    asyncio.run(body())


def test_within_returns_the_result_or_raises_timeout():
    async def body():
        assert await within(asyncio.sleep(0, result=7), 1.0) == 7
        assert await within(asyncio.sleep(0, result=8), None) == 8
        with pytest.raises(TimeoutError):
            await within(asyncio.sleep(1.0), 0.02)
    asyncio.run(body())


def test_the_race_is_real_for_wait_for_on_this_python():
    """Why llmmesh.aio exists: the same loop around asyncio.wait_for does not end on cancel
    (Python 3.11, gh-86296); if a later Python fixes it, this test says so."""
    async def body():
        return [await _cancel_as_the_event_fires(_wait_for) for _ in range(5)]
    results = asyncio.run(body())
    if sys.version_info < (3, 12):
        assert not all(results)


async def _cancelled_as(finish, call) -> str:
    """Start `call`, then in one tick let what it waits on finish and cancel it. Returns
    'cancelled' when the cancel went through, 'returned' when the call went on as if it had not
    been cancelled."""
    task = asyncio.create_task(call())
    for _ in range(3):
        await asyncio.sleep(0)
    finish()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled"
    return "returned"


def test_a_cancelled_replacement_attempt_does_not_take_the_place():
    """A newer attempt waits for the older one to leave the engine. Cancelled as the older one
    ends (its router gave the call up), it must not register itself and go on to run."""
    async def once() -> tuple[str, dict]:
        old = _Attempt(1, "r#1")
        stub = types.SimpleNamespace(_attempts={"r": old},
                                     engine=types.SimpleNamespace(abort=lambda _id: None))

        def old_leaves():
            stub._attempts.pop("r")
            old.ended.set()
        request = types.SimpleNamespace(request_id="r", attempt_key=b"k", attempt=2)
        outcome = await _cancelled_as(old_leaves, lambda: WorkerServicer._take_place(stub, request))
        return outcome, stub._attempts

    async def body():
        for _ in range(20):
            outcome, attempts = await once()
            assert outcome == "cancelled" and attempts == {}
    asyncio.run(body())


def test_a_request_cancelled_as_its_model_finishes_loading_is_cancelled():
    async def once() -> str:
        ready = asyncio.get_running_loop().create_future()
        h = types.SimpleNamespace(state=hosting.LOADING, ready=ready, last_used=0.0)
        stub = types.SimpleNamespace(_hosted=lambda _name: h, estimate_load_s=lambda _h: 1.0)

        def loaded():
            h.state = hosting.LOADED
            ready.set_result(None)
        return await _cancelled_as(
            loaded, lambda: hosting.ModelHost.ensure_loaded(stub, "m", time.time_ns() + 10**10))

    async def body():
        assert [await once() for _ in range(20)] == ["cancelled"] * 20
    asyncio.run(body())
