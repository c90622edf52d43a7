"""`llmmesh up` and the processes it starts do not outlive what they belong to.

`timeout 60 make up` signals make, not `llmmesh up`, so under make `llmmesh up` stops the mesh
when make is gone; and `llmmesh up` itself may be killed with SIGKILL, when it can run no
clean-up at all: then its services and private Redis get SIGTERM from the kernel rather than
hold their ports and the ledger. Started outside make (`nohup llmmesh up &`), the mesh is meant
to outlive the shell, and does."""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def _mesh_up(tmp_path, under_make: bool, nohup: bool = False):
    """`llmmesh up` on free ports, under a real make (as `make up`) or under bash (as a shell
    script that backgrounds it): yields the parent, the log and the mesh's processes (llmmesh up
    first), and ends whatever of them is left."""
    log = tmp_path / "up.log"
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "MAKELEVEL", "MAKEFLAGS")}
    env["PYTHONUNBUFFERED"] = "1"
    up = (f"{sys.executable} -m llmmesh.cli up --var-dir {tmp_path / 'var'} "
          f"--gateway 127.0.0.1:{free_port()} --costd 127.0.0.1:{free_port()} "
          f"--http 127.0.0.1:{free_port()}")
    if under_make:
        makefile = tmp_path / "Makefile"
        makefile.write_text(f"up:\n\t{up}\n")
        argv = ["make", "-s", "-f", str(makefile), "up"]
    else:
        # bash waits: `llmmesh up` is its child (nohup execs it, SIGHUP ignored)
        argv = ["bash", "-c", f"{'nohup ' if nohup else ''}{up}; echo done"]
    with open(log, "w") as out:
        parent = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    mesh_pids: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while "llmmesh is up" not in log.read_text():
            assert parent.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        mesh_pids = _descendants(parent.pid)
        yield parent, log, mesh_pids
    finally:
        parent.kill()
        parent.wait()
        _kill_all(mesh_pids)


@pytest.mark.model
def test_llmmesh_up_stops_the_mesh_when_make_dies(tmp_path):
    """`timeout 60 make up` ends make alone; `llmmesh up`, orphaned and unsignalled, stops the
    mesh itself. Here make is SIGKILLed."""
    with _mesh_up(tmp_path, under_make=True) as (make, log, mesh_pids):
        # llmmesh up, redis-server, costd, a worker, the router and the gateway (at least).
        assert len(mesh_pids) >= 6, mesh_pids
        make.send_signal(signal.SIGKILL)
        make.wait(10)
        left = _wait_gone(mesh_pids, 60)
        assert left == [], f"still running: {left}\n{log.read_text()}"
        assert "make, which started llmmesh up, exited; stopping the mesh" in log.read_text()
        assert "stopped." in log.read_text()


@pytest.mark.model
def test_llmmesh_up_stops_on_sighup_unless_nohup_ignored_it(tmp_path):
    """A closed terminal (SIGHUP) stops the mesh cleanly, as Ctrl-C does."""
    with _mesh_up(tmp_path, under_make=False) as (_, log, mesh_pids):
        os.kill(mesh_pids[0], signal.SIGHUP)   # llmmesh up: bash's only child
        assert _wait_gone(mesh_pids, 60) == [], log.read_text()
        assert "stopped." in log.read_text()


@pytest.mark.model
def test_llmmesh_up_started_outside_make_outlives_its_parent(tmp_path):
    """Started with nohup by a script that then exits (`nohup llmmesh up &`), the mesh keeps
    running, through SIGHUP too; it stops on SIGTERM as before."""
    with _mesh_up(tmp_path, under_make=False, nohup=True) as (shell, log, mesh_pids):
        assert len(mesh_pids) >= 6, mesh_pids
        up_pid = mesh_pids[0]   # bash's only child
        shell.send_signal(signal.SIGKILL)
        shell.wait(10)
        os.kill(up_pid, signal.SIGHUP)
        time.sleep(3)   # three turns of its watch loop
        assert _alive(up_pid) and all(_alive(p) for p in mesh_pids), log.read_text()
        os.kill(up_pid, signal.SIGTERM)
        assert _wait_gone(mesh_pids, 60) == [], log.read_text()
        assert "stopped." in log.read_text()
