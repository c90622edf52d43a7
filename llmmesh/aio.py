"""Timed waits that always let a cancel through.

Not asyncio.wait_for: on Python 3.11 a cancel that lands as the awaited thing finishes is
swallowed (wait_for returns the result instead of raising CancelledError; gh-86296, rewritten in
3.12). A loop around it then runs on for good, and a caller that was cancelled goes on as if it had
not been. make test hung on it once (a router's dispatch loop in a test's teardown); the race
reproduces every time (tests/unit/test_aio.py). asyncio.timeout has no such window."""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """await awaitable for at most timeout_s (None: no limit); TimeoutError past it."""
    async with asyncio.timeout(timeout_s):
        return await awaitable


async def wait_event(event: asyncio.Event, timeout_s: float | None) -> bool:
    """event.wait() for at most timeout_s (None: no limit); True when the event was set."""
    try:
        await within(event.wait(), timeout_s)
        return True
    except TimeoutError:
        return event.is_set()
