"""Two models sharing one worker's engine vs the busy model hosted alone (`make bench-models`).

One process, the real SmolLM2 GGUF as int4 (the busy model) and as fp32 (the second model), on
one ModelHost, so both layouts run on the same cores with the same engine and step loop:

- alone: only int4 is loaded; N interactive requests (distinct prompts: no prefix-cache hits)
  one after another, TTFT each (submit → first token);
- shared: fp32 is loaded beside it and stays idle; the same N requests;

in paired rounds (drift on a shared host hits both), counterbalanced: even rounds measure
alone first, odd ones shared first. Each round loads fp32 cold (its cold-start seconds) and
unloads it after its shared half (the RSS it gave back). Writes bench/results/models.{md,json}.

Not measured here: the layout with one worker per model (a second process on the same two
cores halves each one's CPU, which says nothing about a real fleet) and $ per 1M tokens per
layout from costd; see the README's multi-model section for what follows from these numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

from bench.environment import environment
from llmmesh.catalog import CatalogFile
from llmmesh.tokenizer import Tokenizer
from workers.engine import EngineConfig, SamplingParams
from workers.hosting import ModelHost, rss_bytes

BUSY, SECOND = "smollm2-135m-instruct", "smollm2-135m-instruct-fp32"
RESULTS = os.path.join(os.path.dirname(__file__), "results")


async def ttfts(host: ModelHost, tok: Tokenizer, n: int, tag: str) -> list[float]:
    out = []
    for i in range(n):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content":
              f"Request {tag}-{i}: list {i % 7 + 2} facts about the number {i * 37 + 11}."}]))
        started = time.perf_counter()
        async with host.use(BUSY):
            async for out_ in host.engine.generate(f"{tag}-{i}", ids, SamplingParams(
                    max_tokens=1, temperature=0), model=BUSY):
                if out_.new_token_ids:
                    out.append(time.perf_counter() - started)
                    break
    return out


async def main(args) -> dict:
    host = ModelHost(CatalogFile(args.catalog), EngineConfig(max_num_seqs=8,
                                                             kv_cache_bytes=args.kv_mib << 20))
    await host.start([BUSY])
    tok = host.hosted[BUSY].tokenizer
    await ttfts(host, tok, 5, "warmup")
    rounds = []
    try:
        for r in range(args.rounds):
            # Counterbalanced: even rounds measure alone first, odd rounds shared first, so
            # neither layout always follows a cold load (seconds of full CPU) or an unload.
            before = rss_bytes()
            alone = await ttfts(host, tok, args.requests, f"alone{r}") if r % 2 == 0 else None
            started = time.perf_counter()
            await host.ensure_loaded(SECOND, None)
            cold = time.perf_counter() - started
            loaded_rss = rss_bytes()
            shared = await ttfts(host, tok, args.requests, f"shared{r}")
            h = host.hosted[SECOND]
            await host._unload(h, "bench")
            freed = loaded_rss - rss_bytes()
            if alone is None:
                alone = await ttfts(host, tok, args.requests, f"alone{r}")
            rounds.append({"alone": alone, "shared": shared, "cold_start_s": cold,
                           "second_model_bytes": h.memory_bytes, "rss_before": before,
                           "rss_loaded": loaded_rss, "rss_freed": freed})
            print(f"round {r}: alone p50 {statistics.median(alone) * 1e3:.1f} ms, shared p50 "
                  f"{statistics.median(shared) * 1e3:.1f} ms, cold start {cold:.2f} s, "
                  f"unload freed {freed / 2**20:.0f} MiB", file=sys.stderr)
    finally:
        await host.engine.shutdown()
    return {"rounds": rounds}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def report(data: dict, command: str) -> str:
    env = data["environment"]
    alone = [x for r in data["rounds"] for x in r["alone"]]
    shared = [x for r in data["rounds"] for x in r["shared"]]
    ratios = [statistics.median(r["shared"]) / statistics.median(r["alone"]) for r in data["rounds"]]
    lines = [
        "# Two models on one worker vs the busy model alone", "",
        f"Command: `{command}`  ", f"Commit: {env['commit']}  ", f"Machine: {env['machine']}  ",
        f"Load average at start: {env['load_average_at_start']}", "",
        f"Busy model {BUSY} (int4); second model {SECOND} (fp32) loaded and idle in the shared "
        f"layout. {len(data['rounds'])} paired rounds of {len(data['rounds'][0]['alone'])} "
        "sequential interactive requests (distinct prompts, TTFT = submit to first token, "
        "in-process: the engine's share only).", "",
        "| layout | TTFT p50 (ms) | TTFT p95 (ms) |", "|---|---|---|",
        f"| busy model alone | {statistics.median(alone) * 1e3:.1f} | {pct(alone, 0.95) * 1e3:.1f} |",
        f"| with the second model hosted | {statistics.median(shared) * 1e3:.1f} | "
        f"{pct(shared, 0.95) * 1e3:.1f} |", "",
        f"Shared / alone p50 TTFT: **{statistics.median(shared) / statistics.median(alone):.3f}×** "
        f"over all requests; per round: {', '.join(f'{x:.3f}' for x in ratios)} "
        "(target ≤ 1.05×).", "",
        "| round | cold start of the fp32 model (s) | its weights + KV (MiB) | RSS freed by its unload (MiB) |",
        "|---|---|---|---|"]
    for i, r in enumerate(data["rounds"]):
        lines.append(f"| {i} | {r['cold_start_s']:.2f} | {r['second_model_bytes'] / 2**20:.0f} | "
                     f"{r['rss_freed'] / 2**20:.0f} |")
    lines += ["", "The cold start includes reading and dequantizing the GGUF, allocating the KV "
              "pool and the engine's calibration steps (which teach its step-time model).", ""]
    return "\n".join(lines)


def cli() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.models")
    p.add_argument("--catalog", default="config/models.toml")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--kv-mib", type=int, default=128)
    args = p.parse_args()
    data = asyncio.run(main(args))
    data["environment"] = environment()
    command = "python -m bench.models " + " ".join(sys.argv[1:])
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "models.json"), "w") as f:
        json.dump(data, f, indent=1)
    text = report(data, command.strip())
    with open(os.path.join(RESULTS, "models.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    cli()
