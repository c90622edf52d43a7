"""In-process A/B of a CPU-kernel knob: decode tok/s (and, with --profile, where a step's time
goes) for each setting, alternating settings round by round in one engine.

The hosts these runs share drift by 10-30% between identical runs; alternating in one process
is what makes a 5-20% difference visible. Quote medians, and say which CPU.

    python -m bench.engine.ab --knob vnni_pair_min_rows --settings 0 4 --mode int4 \\
        --concurrency 8 32 --rounds 3 --profile

Knobs are the kernels' `set_tunable` names (vnni, vnni_pair_min_rows, prefetch_bytes,
qgemm_chunks, attention_prefetch, pool_segments, side_prefetch, ...).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.engine import ours
from llmmesh.models import resolve_model
from workers.model.kernels import cpu_kernels

PHASES = ("qkv", "rope+kv", "attention", "o", "gate_up", "down")


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.engine.ab", description=__doc__.split("\n")[0])
    p.add_argument("--knob", required=True, help="a kernels set_tunable name")
    p.add_argument("--settings", nargs="+", type=float, required=True)
    p.add_argument("--mode", default="int4", help="weight mode (int4, int8, fp32)")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true",
                   help="per-phase ms per decode step (decoder stack, output layer, the rest)")
    p.add_argument("--per-step", action="store_true",
                   help="switch the setting every decode step of one batch instead of every "
                        "round: drift on a shared host then falls on every setting alike")
    return p.parse_args(argv)


def _profiled_decode(core, model, n: int, args, tag: str) -> dict[str, float]:
    """ms per pure-decode step at n sequences, by phase."""
    rng = random.Random(tag)
    ours._submit(core, ours._prompts(rng, n, args.prompt_len, core.vocab_size), args.new_tokens, tag)
    started: set[str] = set()
    while len(started) < n:    # prefill: until every sequence has its first token
        started.update(o.request_id for o in core.step() if o.new_token_ids)
    stack, logits = model.decoder_stack, [0.0]
    compute_logits = model.compute_logits

    def timed(hidden):
        t = time.perf_counter()
        out = compute_logits(hidden)
        logits[0] += time.perf_counter() - t
        return out
    model.compute_logits = timed
    stack.set_profiling(True)
    steps, t0 = 0, time.perf_counter()
    try:
        while core.has_work():
            core.step()
            steps += 1
        wall = time.perf_counter() - t0
        phases = stack.profile()
    finally:
        stack.set_profiling(False)
        model.compute_logits = compute_logits
    out = {name: v / steps * 1e3 for name, v in zip(PHASES, phases)}
    out["output layer"] = logits[0] / steps * 1e3
    out["rest"] = (wall - sum(phases) - logits[0]) / steps * 1e3
    out["step"] = wall / steps * 1e3
    return out


def _per_step_decode(core, ext, args, n: int, tag: str) -> dict[float, list[float]]:
    """Seconds of each pure-decode step of n sequences, by setting; the setting changes every
    step (round-robin), so a slow second of the host lands on every setting alike."""
    rng = random.Random(tag)
    ours._submit(core, ours._prompts(rng, n, args.prompt_len, core.vocab_size), args.new_tokens, tag)
    started: set[str] = set()
    while len(started) < n:
        started.update(o.request_id for o in core.step() if o.new_token_ids)
    times: dict[float, list[float]] = {s: [] for s in args.settings}
    i = 0
    while core.has_work():
        s = args.settings[i % len(args.settings)]
        ext.set_tunable(args.knob, s)
        t = time.perf_counter()
        outs = core.step()
        dt = time.perf_counter() - t
        if sum(1 for o in outs if o.new_token_ids) == n:   # a full batch of decode tokens
            times[s].append(dt)
        i += 1
    return times


def _quartile(values: list[float]) -> float:
    return statistics.quantiles(values, n=4)[0] if len(values) >= 4 else min(values)


def main(argv=None) -> None:
    args = _args(argv)
    ext = cpu_kernels()
    if ext is None:
        raise SystemExit("the CPU kernels are not available here")
    core = ours.build_engine(resolve_model().gguf_path, args.mode, "cpu", args.threads,
                             max(args.concurrency))
    model = core.runner.model
    if args.profile and model.decoder_stack is None:
        raise SystemExit(f"--profile needs the fused decoder stack ({args.mode} has none)")
    tok_s: dict[tuple[float, int], list[float]] = {}
    prof: dict[tuple[float, int], list[dict[str, float]]] = {}
    steps: dict[tuple[float, int], list[float]] = {}
    try:
        with torch.inference_mode():
            ours.warm_up(core)
            for r in range(args.rounds):
                if args.per_step:
                    for n in args.concurrency:
                        for s, t in _per_step_decode(core, ext, args, n, f"s{r}-{n}").items():
                            steps.setdefault((s, n), []).extend(t)
                    continue
                for s in args.settings:
                    ext.set_tunable(args.knob, s)
                    for n in args.concurrency:
                        _, decode, _ = ours.measure_throughput(core, n, args.prompt_len,
                                                               args.new_tokens, seed=r * 1000 + n)
                        tok_s.setdefault((s, n), []).append(decode)
                        if args.profile:
                            prof.setdefault((s, n), []).append(
                                _profiled_decode(core, model, n, args, f"p{r}-{s}-{n}"))
    finally:
        ext.set_tunable(args.knob, args.settings[0])
    if args.per_step:
        print(f"{args.knob}, {args.mode}, {args.rounds} rounds, setting switched every step; "
              f"decode tok/s from the median and the lower-quartile step time")
        for n in args.concurrency:
            base = statistics.median(steps[args.settings[0], n])
            for s in args.settings:
                t = steps[s, n]
                med = statistics.median(t)
                print(f"  @{n:<3} {args.knob}={s:g}: {len(t)} steps, median {n / med:.0f} "
                      f"({base / med:.3f}x), lower quartile {n / _quartile(t):.0f}")
        return
    print(f"{args.knob}, {args.mode}, {args.rounds} rounds alternating; decode tok/s")
    for n in args.concurrency:
        base = statistics.median(tok_s[args.settings[0], n])
        for s in args.settings:
            runs = tok_s[s, n]
            med = statistics.median(runs)
            print(f"  @{n:<3} {args.knob}={s:g}: {' '.join(f'{v:.0f}' for v in runs)}"
                  f"  median {med:.0f} ({med / base:.2f}x)")
            if args.profile:
                mean = {k: statistics.fmean(p[k] for p in prof[s, n]) for k in prof[s, n][0]}
                print("        ms/step: " + ", ".join(f"{k} {v:.1f}" for k, v in mean.items()))


if __name__ == "__main__":
    main()
