"""A service whose port is taken exits: serve() raises, and the shutdown hooks still run, so
what the service started before listening (its supervised loops, the gateway's HTTP front)
stops instead of keeping the process alive (CI, 2026-12-03: a gateway given a taken port hung
at exit for over 60 s, one loop's cancellation swallowed)."""
from __future__ import annotations

import asyncio
import socket

import pytest

from llmmesh import server


def test_a_taken_port_raises_and_runs_the_shutdown_hooks():
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    closed = []

    async def close():
        closed.append(1)

    async def body():
        spec = server.ServiceSpec(servicers=[], service_names=[], on_shutdown=[close],
                                  public=True)
        await server.serve(spec, f"127.0.0.1:{squatter.getsockname()[1]}")
    try:
        with pytest.raises(RuntimeError, match="bind"):
            asyncio.run(asyncio.wait_for(body(), timeout=30))
    finally:
        squatter.close()
    assert closed == [1]


def test_a_free_port_serves_and_runs_the_hooks_once_at_stop():
    closed, ready = [], []

    async def close():
        closed.append(1)

    async def body():
        stop = asyncio.Event()
        spec = server.ServiceSpec(servicers=[], service_names=[], on_shutdown=[close],
                                  public=True)
        task = asyncio.create_task(server.serve(spec, "127.0.0.1:0", grace_s=0.1,
                                                ready=ready.append, stop_event=stop))
        while not ready:
            await asyncio.sleep(0.01)
        assert not closed   # not before it stops
        stop.set()
        await asyncio.wait_for(task, timeout=10)
    asyncio.run(body())
    assert closed == [1] and ready[0].startswith("127.0.0.1:")
