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
