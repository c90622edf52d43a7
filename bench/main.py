"""`llmmesh bench` / `python -m bench`: options → run → results JSON, report, plots, curve."""
from __future__ import annotations

import asyncio
import dataclasses
import shlex
import sys
from pathlib import Path

from bench.curve import CURVES_DIR, write_curve
from bench.profile import load_profile
from bench.report import write_report
from bench.runner import Options, TARGETS, run_bench, save
from bench.verdicts import verdicts


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """What the command line asked for (the CLI layer only parses)."""
    profile: str
    scale: float = 1.0
    duration_s: float | None = None
    targets: str = ""  # "": the profile's own list, else every target
    out_dir: str = "bench/results"
    rates: str = ""
    max_requests: int = 0
    workers: int = 1
    llamacpp_parallel: int = 32
    worker_args: str = ""
    threads: int = 0
    gateway: str = ""
    costd: str = ""
    var_dir: str = "var/bench"
    curves_dir: str = str(CURVES_DIR)
    progress: bool = True


def options(req: Request, command: str) -> Options:
    profile = load_profile(req.profile, scale=req.scale, duration_s=req.duration_s)
    if req.rates:
        profile = dataclasses.replace(profile, rates=tuple(float(r) for r in req.rates.split(",")))
    if req.max_requests:
        profile = dataclasses.replace(profile, max_requests=req.max_requests)
    targets = tuple(t.strip() for t in req.targets.split(",") if t.strip()) \
        or profile.targets or TARGETS
    return Options(profile=profile, targets=targets,
                   var_dir=req.var_dir, num_workers=req.workers,
                   worker_args=tuple(shlex.split(req.worker_args)),
                   llamacpp_parallel=req.llamacpp_parallel, threads=req.threads,
                   gateway=req.gateway, costd=req.costd, progress=req.progress, command=command)


def run(req: Request, command: str | None = None) -> dict:
    """Runs the bench and writes bench/results/<profile>.{json,md} and PNGs (and the curve)."""
    command = command or "llmmesh bench " + shlex.join(sys.argv[1:])  # called as a library
    opts = options(req, command)
    results = asyncio.run(run_bench(opts))
    paths = [save(results, req.out_dir)]
    lines = verdicts(results)
    paths.append(write_report(results, req.out_dir, lines))
    curve = write_curve(results, Path(req.curves_dir))
    if curve is not None:
        paths.append(curve)
    results["written"] = [str(p) for p in paths]
    results["verdicts"] = lines
    return results


def rereport(json_path: str, out_dir: str | None = None) -> Path:
    """Rewrites a run's report and plots from its results JSON (no re-run)."""
    import json
    results = json.loads(Path(json_path).read_text())
    return write_report(results, out_dir or Path(json_path).parent, verdicts(results))
