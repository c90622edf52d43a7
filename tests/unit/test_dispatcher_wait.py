"""The dispatcher's timed waits on an event let a cancel through, also one that lands as the
event is set: on Python 3.11, asyncio.wait_for swallows that one and the loop runs on."""
from __future__ import annotations

import asyncio
import contextlib

from router.dispatcher import wait_event


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


def test_wait_event_returns_on_the_event_and_on_the_timeout():
    async def body():
        event = asyncio.Event()
        loop = asyncio.get_running_loop()
        started = loop.time()
        await wait_event(event, 0.05)                       # times out quietly
        assert loop.time() - started >= 0.04
        loop.call_later(0.01, event.set)
        started = loop.time()
        await wait_event(event, 5.0)                        # returns when set, not at 5 s
        assert loop.time() - started < 1.0
    asyncio.run(body())


def test_the_race_is_real_for_wait_for_on_this_python():
    """Why wait_event exists: the same loop around asyncio.wait_for does not end on cancel
    (Python 3.11, gh-86296); if a later Python fixes it, this test says so."""
    import sys

    async def body():
        return [await _cancel_as_the_event_fires(_wait_for) for _ in range(5)]
    results = asyncio.run(body())
    if sys.version_info < (3, 12):
        assert not all(results)
