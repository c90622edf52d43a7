"""What a result was measured on: machine, versions, commit — printed at the top of each report."""
from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _git() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, check=True).stdout.strip()
        # Changed tracked files other than results (an earlier bench in the same checkout
        # rewrites those; untracked links such as a shared .venv change no code either).
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ".", ":(exclude)bench/results"], cwd=REPO, text=True,
                               capture_output=True, check=True).stdout.strip()
        return head + (" (uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "machine": f"{_cpu_model()}, {os.cpu_count()} logical CPUs, "
                   f"{_memory_gib() or 0:.0f} GiB RAM, {platform.system()} {platform.release()}",
        "load_average_at_start": [round(x, 2) for x in load] if load else None,
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in ("torch", "grpcio", "redis", "numpy", "hdrhistogram")},
        "commit": _git(),
    }
