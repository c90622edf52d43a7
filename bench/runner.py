"""One bench run: for each target in turn — start it fresh, warm it up, replay every level of the
profile, stop it — then write the results. Targets run one after another, never together, so
none steals the other's cores, and each starts cold (no prefix cache carried over).
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench import loadgen, metrics, workload
from bench.cost import level_cost
from bench.environment import environment
from bench.profile import Profile
from bench.targets import LlamaCppTarget, MeshTarget, WorkerTarget
from llmmesh.models import resolve_model
from llmmesh.tokenizer import Tokenizer

TARGETS = ("mesh", "worker", "llamacpp")


@dataclass(frozen=True, slots=True)
class Options:
    profile: Profile
    targets: tuple[str, ...] = TARGETS
    var_dir: str = "var/bench"
    num_workers: int = 1
    worker_args: tuple[str, ...] = ()
    llamacpp_parallel: int = 32  # = the worker's default --max-num-seqs: same batch bound
    threads: int = 0  # llama-server threads; 0: llama.cpp's default (physical cores)
    gateway: str = ""  # an external mesh instead of a private one
    costd: str = ""
    # Sent all at once before the first level: as many as llama-server has slots, since its
    # prompt cache is per slot (with 2 sent one by one, its first level paid for the system
    # prompt in up to 30 cold slots and read as its worst). The mesh's one prefix cache needs one.
    warmup_requests: int = 32
    settle_s: float = 1.0  # pause after warm-up and between levels: their spans land apart
    progress: bool = True
    command: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.targets) - set(TARGETS)
        if unknown or not self.targets:
            raise ValueError(f"targets must be among {', '.join(TARGETS)}; got {self.targets}")


@dataclass(frozen=True, slots=True)
class Level:
    label: str
    specs: list
    factor: float = 1.0
    offered_rps: float | None = None
    concurrency: int | None = None  # closed loop
    streams: tuple[str, ...] = field(default=())


def plan_levels(profile: Profile, tok: Tokenizer) -> list[Level]:
    """The sweep: offered loads (open loop) or concurrencies (closed loop), in run order."""
    if profile.closed_loop is not None:
        return [Level(f"c={c}", workload.closed_loop(profile, tok, c), concurrency=c)
                for c in profile.closed_loop.concurrency]
    levels = []
    for i, factor in enumerate(profile.rates):
        if profile.alone:  # the stream's arrivals and lengths from the mix, other words:
            only = (profile.alone,)  # the mix must not find the alone run's prompts cached
            levels.append(Level(f"{profile.alone} alone ×{factor:g}",
                                workload.open_loop(profile, tok, i, factor, only, "alone"),
                                factor, workload.offered_rps(profile, factor, only),
                                streams=only))
        levels.append(Level(f"×{factor:g}", workload.open_loop(profile, tok, i, factor), factor,
                            workload.offered_rps(profile, factor)))
    return levels


def make_target(name: str, opts: Options):
    var = os.path.join(opts.var_dir, name)
    if name == "mesh":
        return MeshTarget(var, opts.num_workers, list(opts.worker_args), opts.gateway, opts.costd)
    if name == "worker":
        return WorkerTarget(var, list(opts.worker_args))
    return LlamaCppTarget(var, opts.llamacpp_parallel, opts.threads)


async def _run_level(target, level: Level, profile: Profile, progress: Progress) -> dict:
    task = progress.add_task(f"{target.name} {level.label}", total=len(level.specs))
    advance = lambda: progress.advance(task)  # noqa: E731
    if level.concurrency is None:
        stats = await loadgen.run_open_loop(target, level.specs, profile.drain_s, advance)
    else:
        stats = await loadgen.run_closed_loop(target, level.specs, level.concurrency,
                                              profile.duration_s, advance)
    summaries = {g: metrics.summarise(g, outs, stats.wall_s, profile.slo)
                 for g, outs in metrics.groups(stats.outcomes).items()}
    whole = summaries["all"]
    # The window opens when the level does: warm-up and earlier levels ended settle_s before.
    bill = await target.bill(stats.started_unix_s, time.time() + 0.5, whole.num_ok)
    loads = getattr(target, "loads", None)
    cost = level_cost(whole.prompt_tokens, whole.completion_tokens, stats.wall_s, whole.device_s,
                      getattr(loads, "device_type", "cpu"), bill)
    return {"label": level.label, "factor": level.factor, "offered_rps": level.offered_rps,
            "concurrency": level.concurrency, "streams": list(level.streams),
            "wall_s": stats.wall_s, "max_send_lag_s": stats.max_send_lag_s,
            "summaries": {g: s.to_dict() for g, s in summaries.items()},
            "load": metrics.load_summary(stats.load_samples), "cost": cost,
            "requests": [_record(o) for o in stats.outcomes]}


def _record(o: loadgen.Outcome) -> list:
    """One request, compact: [class, tenant, ttft_s, tpot_s, e2e_s, completion tokens, error,
    sent_s, prompt tokens] (bench.plots reads these by position)."""
    ok = o.ok
    return [o.spec.request_class, o.spec.tenant, o.ttft_s if ok else None,
            o.tpot_s if ok else None, o.e2e_s if ok else None, o.completion_tokens, o.error,
            round(o.sent_s, 4), len(o.spec.prompt_token_ids)]


async def _run_target(target, opts: Options, levels: list[Level], warm: list,
                      progress: Progress) -> dict:
    started = time.monotonic()
    try:  # start inside: a target that fails half-way still stops what it started
        await target.start()
        if warm:
            await loadgen.run_closed_loop(target, warm, len(warm), opts.profile.drain_s)
            await asyncio.sleep(opts.settle_s)
        results = []
        for level in levels:
            results.append(await _run_level(target, level, opts.profile, progress))
            await asyncio.sleep(opts.settle_s)
        loads = getattr(target, "loads", None)
        return {"describe": target.describe(), "levels": results,
                "device_type": getattr(loads, "device_type", "cpu"),
                "quantization": getattr(loads, "quantization", ""),
                "total_s": time.monotonic() - started}
    finally:
        await target.stop()


async def run_bench(opts: Options, make: Callable = make_target) -> dict:
    """Every target of `opts` in turn (`make(name, opts)` builds one: tests pass fakes)."""
    tok = Tokenizer.from_gguf(resolve_model().gguf_path)
    levels = plan_levels(opts.profile, tok)
    warm = workload.warmup(opts.profile, tok, opts.warmup_requests)
    results = {"profile": asdict(opts.profile), "command": opts.command,
               "environment": environment(), "started_unix_s": time.time(), "targets": {}}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, disable=not opts.progress, transient=False) as progress:
        for name in opts.targets:
            try:
                results["targets"][name] = await _run_target(make(name, opts), opts, levels,
                                                             warm, progress)
            except Exception as exc:  # noqa: BLE001 - one broken peer must not void the others
                results["targets"][name] = {"describe": name, "levels": [],
                                            "error": f"{type(exc).__name__}: {exc}"}
    return results


def save(results: dict, out_dir: str) -> Path:
    os.makedirs(out_dir, exist_ok=True)
    path = Path(out_dir) / f"{results['profile']['name']}.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    return path
