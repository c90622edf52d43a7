"""Background tasks that cannot die silently, and the health they report.

A `Supervisor` runs each of a service's loops (queue reading, lease refresh, cancel watching…):
a loop that raises is logged with its traceback and started again after a jittered, growing
delay, and while any loop is down — or a dependency check fails (Redis unreachable) — the
service's grpc.health.v1 status is NOT_SERVING (llmmesh.server polls `healthy()`).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

from llmmesh.aio import within

log = logging.getLogger("llmmesh.supervisor")

BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 5.0
# A loop that ran this long before failing starts again from the first delay.
STABLE_AFTER_S = 30.0
# stop() cancels a loop again this often while it runs on, for at most STOP_TIMEOUT_S.
RECANCEL_S = 0.05
STOP_TIMEOUT_S = 5.0


class Supervisor:
    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task] = {}
        self.down: dict[str, str] = {}          # loop name -> why it is not running now
        self.checks: dict[str, Callable[[], Awaitable[bool]]] = {}
        self._failed_checks: set[str] = set()
        self.num_restarts = 0
        self._stopping = False

    def start(self, name: str, loop: Callable[[], Awaitable[None]]) -> asyncio.Task:
        task = asyncio.create_task(self._keep_running(name, loop), name=name)
        self.tasks[name] = task
        return task

    def add_check(self, name: str, check: Callable[[], Awaitable[bool]]) -> None:
        """A dependency probe (returns False or raises when the service cannot do its job)."""
        self.checks[name] = check

    async def _keep_running(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        failures = 0
        while True:
            started = time.monotonic()
            try:
                await loop()
                reason = "returned"       # loops run forever: returning is a failure too
                log.error("background task %s returned; starting it again", name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the one place a loop's failure is caught
                reason = f"{type(exc).__name__}: {exc}"
                log.exception("background task %s failed; starting it again", name)
            if self._stopping:   # it ended after its cancellation was lost: not restarted
                return
            if time.monotonic() - started > STABLE_AFTER_S:
                failures = 0
            delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** failures) * random.uniform(0.5, 1.0)
            failures += 1
            self.num_restarts += 1
            self.down[name] = reason
            try:
                await asyncio.sleep(delay)
            finally:
                self.down.pop(name, None)

    async def healthy(self) -> bool:
        """False while a loop is down or a check fails; logs each change once."""
        failed = set()
        for name, check in self.checks.items():
            try:
                if not await within(check(), 2.0):
                    failed.add(name)
            except Exception:  # noqa: BLE001 - a check that cannot answer has failed
                failed.add(name)
        for name in failed - self._failed_checks:
            log.warning("health check %s failing: NOT_SERVING", name)
        for name in self._failed_checks - failed:
            log.info("health check %s passing again", name)
        self._failed_checks = failed
        return not failed and not self.down

    async def stop(self) -> None:
        """Cancel every loop and wait until each has ended.

        One cancel is not always enough: on Python 3.11, `asyncio.wait_for` returns the result
        instead of raising CancelledError when the call it waits on finishes in the same tick
        (gh-86296), and redis-py wraps every socket write in one. The loop then runs on, and a
        wait for it (this one, or `asyncio.run`'s own at exit) never ends: the process hangs
        instead of exiting. So a loop still running is cancelled again, every RECANCEL_S, for at
        most STOP_TIMEOUT_S; one that outlives that is logged and left behind."""
        self._stopping = True
        pending = {t for t in self.tasks.values() if not t.done()}
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
            if pending and time.monotonic() > deadline:
                log.error("background tasks %s did not stop within %.0fs",
                          sorted(t.get_name() for t in pending), STOP_TIMEOUT_S)
                return


def redis_check(redis) -> Callable[[], Awaitable[bool]]:
    async def ping() -> bool:
        return bool(await redis.ping())
    return ping
