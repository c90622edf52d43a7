"""`make bench-scheduling`: the mesh's three scheduling promises measured on the real model,
two workers, in one run.

1. priority: interactive p95 time-to-first-token under a saturating batch flood vs alone;
2. fairness: a tenant sending 10x its rate limit vs another tenant's p95;
3. placement: prefix-affinity vs round-robin on requests sharing system prompts.

Writes bench/results/scheduling.md (+ scheduling.png) with the command that made it.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.environment import environment
from llmmesh import mtls
from llmmesh.identity import Role
from llmmesh.launcher import Mesh
from llmmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc

RESULTS = Path(__file__).parent / "results"
KEYS = {"acme": "llmmesh-demo-acme", "globex": "llmmesh-demo-globex", "noisy": "bench-noisy-key"}
_WORDS = ("river mountain garden engine market energy light music ocean forest village bridge "
          "island harbour winter summer planet machine language history travel letter museum "
          "train bread coffee weather science theory").split()


def tenants_toml(noisy_rpm: int) -> str:
    digest = hashlib.sha256(KEYS["noisy"].encode()).hexdigest()
    return f"""
[tenants.acme]
api_key_sha256 = ["{hashlib.sha256(KEYS['acme'].encode()).hexdigest()}"]
cache_scope = "shared"
[tenants.globex]
api_key_sha256 = ["{hashlib.sha256(KEYS['globex'].encode()).hexdigest()}"]
cache_scope = "shared"
[tenants.noisy]
api_key_sha256 = ["{digest}"]
requests_per_minute = {noisy_rpm}
"""


@dataclass
class Result:
    tenant: str
    request_class: str
    sent_s: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    usage: dict = field(default_factory=dict)
    error: str = ""


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def chat_request(text: str, max_tokens: int, batch: bool = False, system: str = ""):
    req = gateway_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
        request_class=common_pb2.REQUEST_CLASS_BATCH if batch else common_pb2.REQUEST_CLASS_INTERACTIVE)
    if system:
        req.messages.add(role="system", content=system)
    req.messages.add(role="user", content=text)
    return req


async def one(stub, req, tenant: str, t0: float) -> Result:
    r = Result(tenant, "batch" if req.request_class == common_pb2.REQUEST_CLASS_BATCH else "interactive",
               time.perf_counter() - t0)
    try:
        async for msg in stub.Generate(req, metadata=(("authorization", f"Bearer {KEYS[tenant]}"),),
                                       timeout=600):
            now = time.perf_counter() - t0
            if msg.HasField("chunk") and msg.chunk.token_ids and r.ttft_s is None:
                r.ttft_s = now - r.sent_s
            elif msg.HasField("final"):
                r.e2e_s = now - r.sent_s
                u = msg.final.usage
                r.usage = {"prompt": u.prompt_tokens, "cached": u.cached_prompt_tokens,
                           "completion": u.completion_tokens, "worker_queue_s": u.queue_seconds,
                           "prefill_device_s": u.prefill_device_seconds}
    except grpc.aio.AioRpcError as exc:
        r.error = exc.code().name
    return r


async def open_loop(stub, items: list[tuple[float, object, str]], t0: float) -> list[Result]:
    """items: (arrival seconds, request, tenant); fired on schedule whatever the mesh does."""
    tasks = []
    for at, req, tenant in sorted(items, key=lambda x: x[0]):
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(stub, req, tenant, t0)))
    return list(await asyncio.gather(*tasks))


def poisson(rng: random.Random, rate: float, n: int, start: float = 0.0) -> list[float]:
    t, out = start, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def pct(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def ttft_p95(results: list[Result], tenant: str | None = None, cls: str = "interactive"):
    return pct([r.ttft_s for r in results if not r.error and r.request_class == cls
                and (tenant is None or r.tenant == tenant)], 0.95)


def interactive_stream(seed: int, n: int, rate: float, start: float = 0.0, tenant: str = "acme"):
    rng = random.Random(seed)
    return [(at, chat_request(f"In one sentence, what is a {_text(rng, 4)}?", 16), tenant)
            for at in poisson(rng, rate, n, start)]


async def priority_scenario(stub, args) -> dict:
    """Interactive alone, then the same interactive arrivals inside a batch flood."""
    alone = await open_loop(stub, interactive_stream(1, args.interactive_n, args.interactive_rate),
                            time.perf_counter())
    rng = random.Random(2)
    flood = [(0.0, chat_request(f"Summarise: {_text(rng, 120)}", args.batch_tokens, batch=True),
              "globex") for _ in range(args.flood_n)]
    t0 = time.perf_counter()
    inter = interactive_stream(1, args.interactive_n, args.interactive_rate, start=args.flood_lead_s)
    flooded = await open_loop(stub, flood + inter, t0)
    base, under = ttft_p95(alone), ttft_p95(flooded)
    batch_done = [r for r in flooded if r.request_class == "batch" and not r.error]
    last_interactive = max(r.sent_s + (r.e2e_s or 0) for r in flooded if r.request_class == "interactive")
    batch_tokens_in_window = sum(r.usage.get("completion", 0) for r in batch_done
                                 if r.sent_s + (r.e2e_s or 0) <= last_interactive)
    return {"alone_p95_ttft_s": base, "flood_p95_ttft_s": under,
            "alone_p50_ttft_s": pct([r.ttft_s for r in alone], 0.5),
            "flood_p50_ttft_s": pct([r.ttft_s for r in flooded if r.request_class == "interactive"], 0.5),
            "ratio": under / base if base and under else None,
            "batch_completed": len(batch_done), "batch_errors": sum(1 for r in flooded if r.error),
            "batch_tokens_during_interactive": batch_tokens_in_window,
            "ttfts_alone": [r.ttft_s for r in alone], "ttfts_flood": [
                r.ttft_s for r in flooded if r.request_class == "interactive"],
            # (TTFT, worker queue, prefill device seconds) per interactive request: where it went
            "breakdown_alone": [(r.ttft_s, r.usage.get("worker_queue_s"), r.usage.get(
                "prefill_device_s")) for r in alone],
            "breakdown_flood": [(r.ttft_s, r.usage.get("worker_queue_s"), r.usage.get(
                "prefill_device_s")) for r in flooded if r.request_class == "interactive"]}


async def fairness_scenario(stub, args) -> dict:
    """acme at a steady rate alone, then with `noisy` sending 10x its requests-per-minute limit."""
    steady = interactive_stream(3, args.interactive_n, args.interactive_rate)
    alone = await open_loop(stub, steady, time.perf_counter())
    noisy_rate = 10 * args.noisy_rpm / 60.0
    duration = max(at for at, _, _ in steady)
    rng = random.Random(4)
    noise = [(at, chat_request(f"Tell me about {_text(rng, 3)}.", 16), "noisy")
             for at in poisson(rng, noisy_rate, int(noisy_rate * duration) + 1)]
    mixed = await open_loop(stub, steady + noise, time.perf_counter())
    base, under = ttft_p95(alone, "acme"), ttft_p95(mixed, "acme")
    noisy = [r for r in mixed if r.tenant == "noisy"]
    return {"alone_p95_ttft_s": base, "with_noisy_p95_ttft_s": under,
            "increase": under / base - 1 if base and under else None,
            "noisy_sent": len(noisy), "noisy_admitted": sum(1 for r in noisy if not r.error),
            "noisy_refused": sum(1 for r in noisy if r.error == "RESOURCE_EXHAUSTED")}


async def placement_run(stub, args) -> dict:
    rng = random.Random(5)
    systems = [f"You are assistant number {g} for the {_WORDS[g]} team. " + _text(rng, args.system_words)
               for g in range(args.prefix_groups)]
    items = [(0.0, chat_request(f"Question {i}: what is {_text(rng, 3)}?", 4,
                                system=systems[i % len(systems)]), "acme")
             for i in range(args.placement_n)]
    sem = asyncio.Semaphore(args.placement_concurrency)
    t0 = time.perf_counter()

    async def guarded(req):
        async with sem:
            return await one(stub, req, "acme", t0)
    results = await asyncio.gather(*(guarded(req) for _, req, _ in items))
    wall = time.perf_counter() - t0
    ok = [r for r in results if not r.error]
    prompt = sum(r.usage["prompt"] for r in ok)
    return {"hit_rate": sum(r.usage["cached"] for r in ok) / prompt if prompt else 0.0,
            "requests_per_s": len(ok) / wall, "errors": len(results) - len(ok),
            "p50_ttft_s": pct([r.ttft_s for r in ok], 0.5), "wall_s": wall}


async def with_mesh(args, policy: str, body) -> dict:
    var = Path(args.var_dir) / policy
    var.mkdir(parents=True, exist_ok=True)
    tenants = var / "tenants.toml"
    tenants.write_text(tenants_toml(args.noisy_rpm))
    mesh = Mesh(var_dir=str(var), worker_args=["--threads", "1", "--max-num-seqs", "16",
                                               "--kv-cache-mib", str(args.kv_cache_mib)],
                router_args=["--policy", policy], gateway_args=["--tenants", str(tenants)])
    try:
        await mesh.up(num_workers=2, timeout_s=300)
        async with mtls.aio_channel(mesh.procs["worker0"].address, mesh.identity(),
                                    Role.WORKER) as channel:
            load = await worker_pb2_grpc.WorkerServiceStub(channel).GetLoad(
                worker_pb2.GetLoadRequest(), timeout=10)
            args.weights = f"{load.device_type} {load.quantization}"
        async with grpc.aio.insecure_channel(mesh.procs["gateway"].address) as channel:
            return await body(gateway_pb2_grpc.GatewayServiceStub(channel), args)
    finally:
        await asyncio.to_thread(mesh.down)


def _f(x, fmt="{:.3f}"):
    return "n/a" if x is None else fmt.format(x)


def report(res: dict, command: str) -> str:
    p, f, pl = res["priority"], res["fairness"], res["placement"]
    env = environment()
    lines = [
        "# Scheduling benchmark", "", f"Command: `{command}`", "",
        f"Machine: {env['machine']}; load average at start {env['load_average_at_start']}; "
        f"commit {env['commit']}; 2 workers (1 torch thread each), real SmolLM2-135M, "
        f"weights {res['args'].get('weights', '?')}. Ratios matter; absolute "
        "times drift on shared machines.", "",
        "## 1. Interactive under a batch flood", "",
        "| | p50 TTFT s | p95 TTFT s |", "|---|---|---|",
        f"| interactive alone | {_f(p['alone_p50_ttft_s'])} | {_f(p['alone_p95_ttft_s'])} |",
        f"| same arrivals + {res['args']['flood_n']} batch requests | {_f(p['flood_p50_ttft_s'])} "
        f"| {_f(p['flood_p95_ttft_s'])} |", "",
        f"p95 ratio flood/alone: **{_f(p['ratio'], '{:.2f}')}×** (target ≤ 1.5×). Batch completed "
        f"{p['batch_completed']} requests ({p['batch_errors']} errors); it produced "
        f"{p['batch_tokens_during_interactive']} tokens while interactive traffic ran (not starved).", "",
        "## 2. A tenant at 10× its rate limit", "",
        "| | acme p95 TTFT s |", "|---|---|",
        f"| acme alone | {_f(f['alone_p95_ttft_s'])} |",
        f"| acme + noisy at 10× its {res['args']['noisy_rpm']}/min limit | {_f(f['with_noisy_p95_ttft_s'])} |", "",
        f"Increase: **{_f(None if f['increase'] is None else 100 * f['increase'], '{:+.1f}')}%** (target ≤ +20%). "
        f"noisy sent {f['noisy_sent']}, admitted {f['noisy_admitted']}, refused {f['noisy_refused']} "
        "(RESOURCE_EXHAUSTED with RetryInfo).", "",
        f"## 3. Placement: {res['args']['placement_n']} requests over {res['args']['prefix_groups']} "
        f"shared system prompts, concurrency {res['args']['placement_concurrency']}, "
        f"{res['args']['kv_cache_mib']} MiB KV cache per worker", "",
        "| policy | prefix-cache hit rate | requests/s | p50 TTFT s | errors |", "|---|---|---|---|---|"]
    for name, r in pl.items():
        lines.append(f"| {name} | {r['hit_rate']:.1%} | {r['requests_per_s']:.2f} | "
                     f"{_f(r['p50_ttft_s'])} | {r['errors']} |")
    rr, pa = pl.get("round-robin"), pl.get("prefix-affinity")
    if rr and pa and rr["requests_per_s"]:
        lines += ["", f"prefix-affinity vs round-robin: hit rate {pa['hit_rate']:.1%} vs "
                  f"{rr['hit_rate']:.1%}, throughput {pa['requests_per_s'] / rr['requests_per_s']:.2f}×."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, values in (("alone", res["priority"]["ttfts_alone"]),
                          ("under batch flood", res["priority"]["ttfts_flood"])):
        v = sorted(x for x in values if x is not None)
        axes[0].plot(v, [(i + 1) / len(v) for i in range(len(v))], label=label)
    axes[0].set(xlabel="interactive TTFT (s)", ylabel="CDF", title="Interactive first token")
    axes[0].legend()
    names = list(res["placement"])
    axes[1].bar(names, [res["placement"][n]["hit_rate"] * 100 for n in names])
    axes[1].set(ylabel="prefix-cache hit rate (%)", title="Placement policy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.scheduling")
    p.add_argument("--interactive-n", type=int, default=30)
    p.add_argument("--interactive-rate", type=float, default=0.5, help="requests/s")
    p.add_argument("--flood-n", type=int, default=64)
    p.add_argument("--flood-lead-s", type=float, default=5.0)
    p.add_argument("--batch-tokens", type=int, default=96)
    p.add_argument("--noisy-rpm", type=int, default=30)
    p.add_argument("--placement-n", type=int, default=200)
    p.add_argument("--prefix-groups", type=int, default=8)
    p.add_argument("--system-words", type=int, default=300)
    p.add_argument("--placement-concurrency", type=int, default=8)
    p.add_argument("--kv-cache-mib", type=int, default=96)
    p.add_argument("--var-dir", default="var/bench-scheduling")
    p.add_argument("--scenarios", nargs="+", default=["priority", "fairness", "placement"],
                   choices=["priority", "fairness", "placement"],
                   help="run a subset while iterating (the report needs all three)")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


async def main_async(args) -> dict:
    res = {"args": vars(args)}

    async def priority_and_fairness(stub, a):
        out = {}
        if "priority" in a.scenarios:
            out["priority"] = await priority_scenario(stub, a)
        if "fairness" in a.scenarios:
            out["fairness"] = await fairness_scenario(stub, a)
        return out
    if {"priority", "fairness"} & set(args.scenarios):
        res.update(await with_mesh(args, "prefix-affinity", priority_and_fairness))
    if "placement" in args.scenarios:
        res["placement"] = {}
        for policy in ("round-robin", "prefix-affinity"):
            res["placement"][policy] = await with_mesh(args, policy, placement_run)
    return res


def main(argv=None) -> None:
    args = _args(argv)
    command = "python -m bench.scheduling " + " ".join(sys.argv[1:] if argv is None else argv)
    res = asyncio.run(main_async(args))
    if len(args.scenarios) < 3:   # a partial run: print, do not overwrite the report
        print(json.dumps({k: v for k, v in res.items() if k != "args"}, indent=1, default=str))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scheduling.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "scheduling.md").write_text(report(res, command.strip()))
    plot(res, out / "scheduling.png")
    print((out / "scheduling.md").read_text())


if __name__ == "__main__":
    main()
