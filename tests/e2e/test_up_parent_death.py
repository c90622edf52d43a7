"""`llmmesh up` and the processes it starts do not outlive whoever started them.

`timeout 60 make up` signals make, not `llmmesh up`; a closed terminal sends SIGHUP; and
`llmmesh up` itself may be killed with SIGKILL, when it can run no clean-up at all. In each
case the services and the private Redis must stop rather than hold their ports and the ledger."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmmesh.launcher import REPO_ROOT, free_port

pytestmark = [pytest.mark.e2e]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"   # a zombie has exited; only its parent's wait is missing


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# A parent that starts the private Redis through the launcher, prints its pid, then waits.
_PARENT = """
import sys, time
from llmmesh.launcher import Mesh
mesh = Mesh(var_dir=sys.argv[1], die_with_parent=sys.argv[2] == "1")
mesh.start_redis()
mesh.wait_redis()
print(mesh.procs["redis"].popen.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("die_with_parent", [True, False])
def test_the_private_redis_stops_when_its_launcher_is_killed_outright(tmp_path, die_with_parent):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path), str(int(die_with_parent))],
                              cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    redis_pid = None
    try:
        redis_pid = int(parent.stdout.readline())
        assert _alive(redis_pid)
        parent.send_signal(signal.SIGKILL)   # no handler, no finally, no atexit
        parent.wait(10)
        left = _wait_gone([redis_pid], 5 if die_with_parent else 1.5)
        # With the flag the orphan gets SIGTERM; without it (the code before) it lives on.
        assert left == ([] if die_with_parent else [redis_pid])
    finally:
        parent.kill()
        parent.wait()
        if redis_pid:
            _kill_all([redis_pid])


@pytest.mark.model
def test_llmmesh_up_stops_the_mesh_when_what_started_it_dies(tmp_path):
    """`bash -c 'llmmesh up; ...'` stands for make: killing it leaves `llmmesh up` orphaned
    and unsignalled, as `timeout 60 make up` does."""
    log = tmp_path / "up.log"
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PYTHONUNBUFFERED"] = "1"
    up = (f"{sys.executable} -m llmmesh.cli up --var-dir {tmp_path / 'var'} "
          f"--gateway 127.0.0.1:{free_port()} --costd 127.0.0.1:{free_port()} "
          f"--http 127.0.0.1:{free_port()}")
    with open(log, "w") as out:
        shell = subprocess.Popen(["bash", "-c", f"{up}; echo done"], cwd=REPO_ROOT, env=env,
                                 stdout=out, stderr=subprocess.STDOUT)
    mesh_pids: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while "llmmesh is up" not in log.read_text():
            assert shell.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        mesh_pids = _descendants(shell.pid)
        # llmmesh up, redis-server, costd, a worker, the router and the gateway (at least).
        assert len(mesh_pids) >= 6, mesh_pids
        shell.send_signal(signal.SIGKILL)
        shell.wait(10)
        left = _wait_gone(mesh_pids, 60)
        assert left == [], f"still running: {left}\n{log.read_text()}"
        assert "the process that started llmmesh up exited; stopping the mesh" in log.read_text()
        assert "stopped." in log.read_text()
    finally:
        shell.kill()
        shell.wait()
        _kill_all(mesh_pids)
