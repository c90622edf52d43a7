"""The supervisor: a loop that raises is logged and started again, health is false while it is
down or a check fails, and true again once both recover."""
from __future__ import annotations

import asyncio

from llmmesh import supervisor as sup


def test_a_failing_loop_is_restarted_and_health_follows_it(monkeypatch, caplog):
    monkeypatch.setattr(sup, "BACKOFF_FIRST_S", 0.05)
    runs = []

    async def flaky():
        runs.append(1)
        if len(runs) < 3:
            raise ValueError("undecodable lease")
        await asyncio.Event().wait()     # the third run stays up

    async def body():
        s = sup.Supervisor()
        s.start("registry", flaky)
        await asyncio.sleep(0)
        down = await s.healthy()
        while len(runs) < 3:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
        up = await s.healthy()
        await s.stop()
        return down, up, s.num_restarts
    down, up, restarts = asyncio.run(body())
    assert (down, up, restarts) == (False, True, 2)
    assert caplog.text.count("background task registry failed") == 2
    assert "undecodable lease" in caplog.text


def test_a_failing_check_makes_it_unhealthy_until_it_passes():
    state = {"ok": False}

    async def check():
        if state["ok"] is None:
            raise ConnectionError("redis gone")
        return state["ok"]

    async def body():
        s = sup.Supervisor()
        s.add_check("redis", check)
        seen = [await s.healthy()]
        state["ok"] = None
        seen.append(await s.healthy())
        state["ok"] = True
        seen.append(await s.healthy())
        return seen
    assert asyncio.run(body()) == [False, False, True]


def _swallows_cancellation(times: dict, ran_after: list):
    """A loop that drops its first `times["n"]` cancellations, as Python 3.11's asyncio.wait_for
    does when the call it waits on (a redis-py socket write) finishes in the same tick."""
    async def loop():
        dropped = 0
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if dropped >= times["n"]:
                    raise
                dropped += 1
                ran_after.append(dropped)
    return loop


def test_stop_ends_a_loop_that_swallowed_its_cancellation():
    ran_after = []

    async def body():
        s = sup.Supervisor()
        s.start("epoch", _swallows_cancellation({"n": 2}, ran_after))
        await asyncio.sleep(0.02)
        await asyncio.wait_for(s.stop(), timeout=2.0)   # hung for ever before
        return s.tasks["epoch"]
    task = asyncio.run(body())
    assert task.cancelled() and ran_after == [1, 2]


def test_stop_gives_up_on_a_loop_that_never_ends_and_says_which(monkeypatch, caplog):
    monkeypatch.setattr(sup, "STOP_TIMEOUT_S", 0.2)
    ran_after = []

    async def body():
        s = sup.Supervisor()
        times = {"n": 10**9}
        s.start("stubborn", _swallows_cancellation(times, ran_after))
        await asyncio.sleep(0.02)
        await asyncio.wait_for(s.stop(), timeout=2.0)
        done = s.tasks["stubborn"].done()
        times["n"] = 0   # the test's own clean-up: the next cancellation ends it
        s.tasks["stubborn"].cancel()
        await asyncio.gather(s.tasks["stubborn"], return_exceptions=True)
        return done
    assert asyncio.run(body()) is False
    assert len(ran_after) >= 3   # cancelled again, more than once
    assert "background tasks ['stubborn'] did not stop within" in caplog.text
