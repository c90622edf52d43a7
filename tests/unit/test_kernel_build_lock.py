"""A kernel build lock left by a process killed mid-build no longer hangs every later worker."""
from __future__ import annotations

import subprocess
import sys

from workers.model import kernels


def test_a_stale_torch_build_lock_is_removed_under_our_lock(tmp_path):
    (tmp_path / "lock").touch()               # what a builder killed mid-build leaves behind
    with kernels._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_our_lock_is_released_when_its_holder_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"f = open({str(tmp_path / 'llmmesh.flock')!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
    finally:
        holder.kill()
        holder.wait()
    with kernels._build_lock(tmp_path):       # would block forever if the lock outlived it
        pass
