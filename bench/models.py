"""Two models sharing one worker's engine vs the busy model hosted alone (`make bench-models`).

One process, the real SmolLM2 GGUF as int4 (the busy model) and as fp32 (the second model), on
one ModelHost, so both layouts run on the same cores with the same engine and step loop:

- alone: only int4 is loaded; N interactive requests (distinct prompts: no prefix-cache hits)
  one after another, TTFT each (submit → first token);
- shared: fp32 is loaded beside it and stays idle; the same N requests;

in paired rounds (drift on a shared host hits both), counterbalanced: even rounds measure
alone first, odd ones shared first. Each round loads fp32 cold (its cold-start seconds) and
unloads it after its shared half (the RSS it gave back).

Then alternating demand: blocks of requests that switch between the two models, (a) with both
resident and (b) under a memory budget that holds one, so every switch is a cold start; beside
them each model alone, which is what a worker of its own gives it (one worker per model on
these same two cores would halve each one's CPU, which says nothing about a real fleet, so
that layout is this process with one model loaded). Each model's throughput curve is measured
alone (concurrency 1 and 4), and costd's consolidation what-if (costd/whatif/consolidation.py)
prices both layouts from those curves, the measured memory and the measured cold start over
the two-region diurnal profile (bench/profiles/consolidation.json) at the price book's CPU
price: $ per 1M tokens with one device per model vs the models sharing one, when the device
holds both and when it holds one. Writes bench/results/models.{md,json}.
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
PROFILES = os.path.join(os.path.dirname(__file__), "profiles")


def prompt_ids(tok: Tokenizer, tag: str, i: int) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content":
                      f"Request {tag}-{i}: list {i % 7 + 2} facts about the number {i * 37 + 11}."}]))


async def ttfts(host: ModelHost, tok: Tokenizer, n: int, tag: str,
                model: str = BUSY) -> list[float]:
    """TTFT of n sequential requests to `model`, loading it first if it is not (the first
    request then pays the cold start, as a client would)."""
    out = []
    for i in range(n):
        ids = prompt_ids(tok, tag, i)
        started = time.perf_counter()
        async with host.use(model):
            async for out_ in host.engine.generate(f"{tag}-{i}", ids, SamplingParams(
                    max_tokens=1, temperature=0), model=model):
                if out_.new_token_ids:
                    out.append(time.perf_counter() - started)
                    break
    return out


async def throughput_point(host: ModelHost, model: str, concurrency: int, tag: str,
                           max_tokens: int = 32) -> dict:
    """One curve point of `model` alone: `concurrency` requests at once; prefill tokens/s
    until every first token, decode tokens/s after it (the curve format of costd.whatif)."""
    tok = host.hosted[model].tokenizer
    prompts = [prompt_ids(tok, tag, i) for i in range(concurrency)]
    firsts, ends, made = [], [], []

    async def one(i: int) -> None:
        n = 0
        async for out in host.engine.generate(f"{tag}-{i}", prompts[i], SamplingParams(
                max_tokens=max_tokens, temperature=0, ignore_eos=True), model=model):
            if out.new_token_ids and not n:
                firsts.append(time.perf_counter())
            n += len(out.new_token_ids)
        ends.append(time.perf_counter())
        made.append(n)

    async with host.use(model):
        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(concurrency)))
    prefill_s, decode_s = max(firsts) - started, max(ends) - max(firsts)
    return {"concurrency": concurrency,
            "prefill_tokens_per_s": sum(map(len, prompts)) / prefill_s,
            "decode_tokens_per_s": (sum(made) - concurrency) / decode_s}


async def alternating(host: ModelHost, toks: dict, blocks: int, per_block: int,
                      tag: str) -> list[dict]:
    """Blocks of sequential requests alternating between the models; TTFT of each, with its
    block and position (position 0 pays any cold start the switch causes)."""
    out = []
    for b in range(blocks):
        model = (BUSY, SECOND)[b % 2]
        for i, t in enumerate(await ttfts(host, toks[model], per_block, f"{tag}{b}", model)):
            out.append({"block": b, "position": i, "model": model, "ttft_s": t})
    return out


def price_layouts(curves: dict, memory_mib: dict, load_s: dict, device_memory_mib: float) -> dict:
    """costd's consolidation what-if over the two-region diurnal profile, from what was
    measured here."""
    from costd.pricebook import PriceBook
    from costd.whatif.consolidation import ModelLoad, consolidate
    from costd.whatif.curve import parse_curve
    from costd.whatif.profile import Scenario, TrafficProfile

    with open(os.path.join(PROFILES, "consolidation.json")) as f:
        spec = json.load(f)
    with open("config/prices.toml") as f:
        book = PriceBook.parse(f.read())
    price = book.price(book.device_for("cpu") or "cpu", time.time_ns()).per_hour
    models = []
    for name, m in zip((BUSY, SECOND), spec["models"]):
        curve = parse_curve(json.dumps(curves[name]), name)
        models.append(ModelLoad(name, TrafficProfile.from_json(m["profile"]), curve,
                                memory_mib[name], load_s[name]))
    result = consolidate(models, Scenario(device="cpu"), price, device_memory_mib)
    return {"device_memory_mib": device_memory_mib, "price_per_hour": str(price),
            "dedicated_per_million": str(result.dedicated.cost_per_million_tokens),
            "shared_per_million": str(result.shared.cost_per_million_tokens),
            "dedicated_device_hours": result.dedicated.device_hours,
            "shared_device_hours": result.shared.device_hours,
            "shared_loading_s": result.shared.loading_s, "saving_pct": result.saving_pct,
            "cheaper": result.cheaper, "caveats": list(result.caveats)}


def unpinned_catalog(path: str, out_dir: str) -> str:
    """The catalog with nothing pinned, so a budget for one model can unload either."""
    with open(path) as f:
        text = f.read().replace("pinned = true", "pinned = false")
    out = os.path.join(out_dir, "models-bench.toml")
    with open(out, "w") as f:
        f.write(text)
    return out


async def main(args) -> dict:
    import tempfile
    catalog = unpinned_catalog(args.catalog, tempfile.mkdtemp(prefix="bench-models-"))
    host = ModelHost(CatalogFile(catalog), EngineConfig(max_num_seqs=8,
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
        data = {"rounds": rounds}
        if args.blocks:
            data.update(await alternating_phase(host, args))
    finally:
        await host.engine.shutdown()
    return data


async def alternating_phase(host: ModelHost, args) -> dict:
    """Each model alone (its own worker), both resident, a budget for one; then the curves
    and costd's prices."""
    await host.ensure_loaded(SECOND, None)
    toks = {m: host.hosted[m].tokenizer for m in (BUSY, SECOND)}
    memory_mib = {m: host.hosted[m].memory_bytes / 2**20 for m in (BUSY, SECOND)}
    both = await alternating(host, toks, args.blocks, args.per_block, "both")
    curves, alone = {}, {}
    for model, other in ((BUSY, SECOND), (SECOND, BUSY)):
        await host._unload(host.hosted[other], "bench: alone")
        alone[model] = await ttfts(host, toks[model], args.per_block * args.blocks // 2,
                                   f"alone-{model}", model)
        points = [await throughput_point(host, model, c, f"curve-{model}-{c}") for c in (1, 4)]
        curves[model] = {"format": "llmmesh.throughput-curve/v1", "name": f"measured-{model}",
                         "device_type": "cpu", "model": model,
                         "quantization": host.hosted[model].quantization, "points": points}
        await host.ensure_loaded(other, None)
        print(f"{model} alone: p50 TTFT {statistics.median(alone[model]) * 1e3:.1f} ms, "
              f"curve {points}", file=sys.stderr)
    # A budget that holds the larger model and not both: every switch unloads one, loads the other.
    host.memory_budget_bytes = int(max(memory_mib.values()) * 1.15) << 20
    await host._unload(host.hosted[SECOND], "bench: budget for one")   # block 0 asks for BUSY
    one = await alternating(host, toks, args.blocks, args.per_block, "one")
    host.memory_budget_bytes = 0
    load_s = {m: statistics.median([r["ttft_s"] for r in one if r["model"] == m
                                    and r["position"] == 0 and r["block"] > 0])
              for m in (BUSY, SECOND)}
    prices = [price_layouts(curves, memory_mib, load_s, mib)
              for mib in (sum(memory_mib.values()) * 1.2, max(memory_mib.values()) * 1.15)]
    return {"alternating": {"both_resident": both, "budget_for_one": one, "alone": alone,
                            "memory_mib": memory_mib, "load_s": load_s,
                            "budget_mib": max(memory_mib.values()) * 1.15},
            "curves": curves, "prices": prices}


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
    if "alternating" in data:
        lines += alternating_report(data)
    return "\n".join(lines)


def alternating_report(data: dict) -> list[str]:
    a = data["alternating"]
    per_block = 1 + max(r["position"] for r in a["both_resident"])
    blocks = 1 + max(r["block"] for r in a["both_resident"])

    def cell(rows: list[dict], model: str, first: bool) -> str:
        xs = [r["ttft_s"] for r in rows if r["model"] == model and (r["position"] == 0) == first
              and not (first and r["block"] == 0)]
        return f"{statistics.median(xs) * 1e3:.1f} / {pct(xs, 0.95) * 1e3:.1f}" if xs else "-"

    lines = ["## Alternating demand", "",
             f"{blocks} blocks of {per_block} sequential requests, switching model every block. "
             "Dedicated: the model alone in the worker (what a worker of its own gives it). "
             f"Budget for one: {a['budget_mib']:.0f} MiB, so every switch unloads one model and "
             "cold-starts the other inside the first request of the block.", "",
             "| layout | model | TTFT p50 / p95 (ms), requests after the first of a block | "
             "first request after a switch (ms) |", "|---|---|---|---|"]
    for model in (BUSY, SECOND):
        xs = a["alone"][model]
        lines.append(f"| dedicated (alone) | {model} | {statistics.median(xs) * 1e3:.1f} / "
                     f"{pct(xs, 0.95) * 1e3:.1f} | - |")
    for label, key in (("shared, both resident", "both_resident"),
                       ("shared, budget for one", "budget_for_one")):
        for model in (BUSY, SECOND):
            lines.append(f"| {label} | {model} | {cell(a[key], model, False)} | "
                         f"{cell(a[key], model, True)} |")
    lines += ["", "Measured curves (each model alone): " + "; ".join(
        f"{m}: " + ", ".join(f"c={p['concurrency']} prefill {p['prefill_tokens_per_s']:.0f} "
                             f"decode {p['decode_tokens_per_s']:.0f} tok/s" for p in c["points"])
        for m, c in data["curves"].items()),
        "Memory (weights + KV): " + ", ".join(f"{m} {v:.0f} MiB" for m, v in
                                              a["memory_mib"].items()) + "; cold start (median "
        "first-request TTFT after a switch): " + ", ".join(f"{m} {v:.2f} s" for m, v in
                                                         a["load_s"].items()), "",
        "### $ per 1M tokens of each layout (costd's consolidation what-if)", "",
        "Over the two-region diurnal profile (bench/profiles/consolidation.json: the diurnal "
        "profile and the same 12 h later, one model each), from the curves, memory and cold "
        "start above, at the price book's CPU price.", "",
        "| device memory (MiB) | one device per model: $/1M, device-h | shared: $/1M, device-h, "
        "loading s | cheaper | saving |", "|---|---|---|---|---|"]
    for p in data["prices"]:
        saving = f"{p['saving_pct']:.1f}%" if p["saving_pct"] is not None else "-"
        lines.append(f"| {p['device_memory_mib']:.0f} | {p['dedicated_per_million']}, "
                     f"{p['dedicated_device_hours']} | {p['shared_per_million']}, "
                     f"{p['shared_device_hours']}, {p['shared_loading_s']:.1f} | {p['cheaper']} | "
                     f"{saving} |")
    lines += ["", "Caveats (costd's): " + " ".join(data["prices"][0]["caveats"]), ""]
    return lines


def cli() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.models")
    p.add_argument("--catalog", default="config/models.toml")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--kv-mib", type=int, default=128)
    p.add_argument("--blocks", type=int, default=6,
                   help="alternating-demand blocks (0: skip that phase)")
    p.add_argument("--per-block", type=int, default=8)
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
