"""The launcher picks free ports by binding and releasing them, so another process can take one
before the service binds it. A service that exits for that reason is started again, once, on
new ports; one given an address that is taken still fails, naming its log."""
from __future__ import annotations

import asyncio
import socket

import pytest

from llmmesh import launcher
from llmmesh.launcher import Mesh

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def test_a_service_that_lost_its_port_to_a_race_is_started_again(tmp_path, monkeypatch):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real, calls = launcher.free_port, []

    def racy_free_port():   # the gateway's HTTP port (its second pick) is taken meanwhile
        calls.append(1)
        return taken if len(calls) == 2 else real()

    mesh = Mesh(var_dir=str(tmp_path))
    try:
        mesh.start_redis()
        mesh.start_service("costd", "costd")
        asyncio.run(mesh.wait_ready(["costd"], 120))
        calls.clear()
        monkeypatch.setattr(launcher, "free_port", racy_free_port)
        first = mesh.start_service("gateway", "gateway")
        assert first.http_address == f"127.0.0.1:{taken}"
        asyncio.run(mesh.wait_ready(["gateway"], 120))
        again = mesh.procs["gateway"]
        assert again is not first and again.alive() and again.http_address != first.http_address
        # An address the caller gave is not the launcher's to change: it fails, naming the log.
        with pytest.raises(RuntimeError, match=r"gateway2 exited .*gateway2\.log"):
            mesh.start_service("gateway2", "gateway", address=f"127.0.0.1:{taken}")
            asyncio.run(mesh.wait_ready(["gateway2"], 60))
    finally:
        mesh.down()
        squatter.close()
