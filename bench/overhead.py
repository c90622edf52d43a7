"""What the mesh adds over its own worker called directly, measured in pairs.

`python -m bench.overhead` starts one private mesh and sends requests alternately through the
gateway (gateway -> Redis -> router -> worker -> router -> Redis -> gateway) and straight to
that same worker over gRPC, one at a time, each pair in a random order. Both paths see the same
process, the same machine load at nearly the same moment and equally fresh prompts (every
request has its own document; only the chat template's opening is shared, and cached, on both
paths), so the paired differences isolate the mesh. Running the two paths one after the other
(the overhead profile of `python -m bench`) lets a neighbour's load swing decide the answer on a
shared host. Writes bench/results/overhead-paired.{md,json} with the command that made them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import statistics
import sys
import time
from pathlib import Path

from bench import fronts, tls_hop
from bench.environment import environment
from bench.profile import load_profile
from bench.targets import HttpMeshTarget, MeshTarget, WorkerTarget
from bench.workload import closed_loop
from llmmesh.models import resolve_model
from llmmesh.tokenizer import Tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_TTFT_MS, TARGET_TPOT_MS = 5.0, 0.5
# Issue 17: what the HTTP front adds over the gRPC front, same mesh, same run.
TARGET_HTTP_TTFT_MS, TARGET_HTTP_TPOT_MS = 1.0, 0.1


async def _timed(target, spec) -> dict:
    """TTFT and time per output token after the first, from the client's side."""
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    usage: dict = {}
    async for event in target.stream(spec):
        if isinstance(event, int):
            if event and first is None:
                first = time.perf_counter()
            if event:
                last = time.perf_counter()
                tokens += event
        else:
            usage = event
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    if tokens and usage.get("completion_tokens", tokens) != tokens:
        # A chunk with no new text (half a UTF-8 character) is not sent over HTTP: the span from
        # first to last chunk still covers the same tokens.
        tpot = (last - first) / (usage["completion_tokens"] - 1)
    # The part of TTFT spent outside the engine: the prefill's device time (the same work on
    # both paths, and most of the run-to-run noise) taken out. Not usage's queue time: through
    # the mesh it counts from the gateway's enqueue, so it holds the very hops measured here.
    engine_s = usage.get("prefill_device_s", 0.0)
    row = {"ttft_s": first - sent, "tpot_s": tpot, "tokens": tokens,
           "ttft_outside_engine_s": first - sent - engine_s}
    if "request_id" in usage:      # HTTP: the prefill's device time comes from the ledger later
        row["request_id"], row["ttft_outside_engine_s"] = usage["request_id"], None
    return row


async def _prefill_from_ledger(ledger: str, rows: list[dict], timeout_s: float = 30.0) -> None:
    """Fill ttft_outside_engine_s of rows that carry a mesh request id, from costd's ledger."""
    want = {r["request_id"]: r for r in rows if r.get("request_id")}
    deadline = time.monotonic() + timeout_s
    while want and time.monotonic() < deadline:
        conn = sqlite3.connect(ledger)
        try:
            marks = ",".join("?" * len(want))
            for rid, prefill in conn.execute(f"SELECT request_id, prefill_device_s FROM usage_records "
                                             f"WHERE request_id IN ({marks})", list(want)):
                row = want.pop(rid)
                row["ttft_outside_engine_s"] = row["ttft_s"] - prefill
        except sqlite3.OperationalError:
            pass   # the ledger is not there yet
        finally:
            conn.close()
        await asyncio.sleep(0.5)


async def measure(pairs: int, seed: int, worker_args: list[str]) -> dict:
    profile = load_profile("overhead")
    tok = Tokenizer.from_gguf(resolve_model().gguf_path)
    # Distinct documents for every request (a repeated prompt would be a prefix-cache hit for
    # whichever path sent it second): the closed-loop generator's slots give as many as needed.
    per_slot = profile.closed_loop.requests_per_slot
    specs = closed_loop(profile, tok, -(-(3 * pairs + 6) // per_slot))
    assert len({s.prompt_token_ids for s in specs}) == len(specs), "prompts must be distinct"
    rng = random.Random(seed)
    mesh = MeshTarget("var/bench-overhead", 1, worker_args)
    await mesh.start()
    direct = WorkerTarget("var/bench-overhead-direct", attach_address=mesh.worker_addresses[0],
                          tls_dir=mesh.mesh.tls_dir)
    await direct.start()
    http = HttpMeshTarget(mesh.mesh.procs["gateway"].http_address)
    await http.start()
    rows = []
    try:
        for spec in specs[:6]:                 # warm every path (first calls, allocator)
            for target in (mesh, direct, http):
                await _timed(target, spec)
        for i in range(pairs):
            order = [("mesh", mesh), ("direct", direct), ("http", http)]
            rng.shuffle(order)
            row = {}
            for j, (name, target) in enumerate(order):
                row[name] = await _timed(target, specs[6 + 3 * i + j])
            rows.append(row)
        await _prefill_from_ledger(str(Path(mesh.mesh.var_dir) / "ledger.sqlite"),
                                   [r["http"] for r in rows])
    finally:
        await http.stop()
        await direct.stop()
        await mesh.stop()
    return {"pairs": rows, "describe": mesh.describe()}


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.1f}"


def summarise(rows: list[dict], over: str = "mesh", base: str = "direct") -> dict:
    out = {}
    for metric in ("ttft_s", "tpot_s", "ttft_outside_engine_s"):
        pairs = [(r[over][metric], r[base][metric]) for r in rows
                 if over in r and base in r
                 and r[over].get(metric) is not None and r[base].get(metric) is not None]
        if not pairs:
            continue
        diffs = [m - d for m, d in pairs]
        out[metric] = {
            "mesh_p50": statistics.median(m for m, _ in pairs),
            "direct_p50": statistics.median(d for _, d in pairs),
            "added_p50": statistics.median(diffs),
            # Middle half of the paired differences: how much the reading moves.
            "added_q1": statistics.quantiles(diffs, n=4)[0],
            "added_q3": statistics.quantiles(diffs, n=4)[2],
            "n": len(pairs)}
    return out


def report(result: dict, command: str, env: dict) -> str:
    s = result["summary"]
    lines = ["# Mesh overhead, paired", "",
             f"- command: `{command}`",
             f"- machine: {env['machine']}; load average at start {env['load_average_at_start']}; "
             f"commit {env['commit']}",
             f"- {result['describe']}; the mesh's worker also called directly; "
             f"{s['ttft_s']['n']} pairs, one request at a time, random order within each pair",
             "- request: the overhead profile's closed-loop shape (64-token prompt, 32 tokens, "
             "greedy), a fresh document per request", "",
             f"Issue 6 target: ≤ {TARGET_TTFT_MS:g} ms added p50 TTFT, ≤ {TARGET_TPOT_MS:g} ms "
             "added per token. \"added\" is the median of the per-pair differences "
             "(mesh − direct); q1–q3 is the middle half of those differences. The last row is "
             "diagnostic, not the target: TTFT minus the prefill's device time "
             "(from its usage report), i.e. the hops alone, without the prefill's run-to-run "
             "noise.", "",
             "| metric | mesh p50 (ms) | direct p50 (ms) | added, median of pairs (ms) | q1 – q3 (ms) | target |",
             "|---|---|---|---|---|---|"]
    for metric, name, limit in (("ttft_s", "TTFT", TARGET_TTFT_MS),
                                ("tpot_s", "time per output token", TARGET_TPOT_MS),
                                ("ttft_outside_engine_s", "TTFT outside the engine", None)):
        m = s.get(metric)
        if m is None:
            continue
        added = m["added_p50"] * 1e3
        verdict = "(diagnostic)" if limit is None else f"≤ {limit:g} {'✅' if added <= limit else '❌'}"
        lines.append(f"| {name} | {_ms(m['mesh_p50'])} | {_ms(m['direct_p50'])} | "
                     f"{added:+.2f} | {m['added_q1'] * 1e3:+.2f} – {m['added_q3'] * 1e3:+.2f} | "
                     f"{verdict} |")
    if result.get("tls_hop"):
        hop = result["tls_hop"]
        lines += ["", "## What mutual TLS adds (same run)", "",
                  "The mesh above runs with mutual TLS on every internal hop (the only mode) and "
                  "signs every result-stream event (llmmesh.streamauth). What TLS alone adds to "
                  "one warm internal hop (bench.tls_hop: plaintext and mTLS calls alternate on one "
                  "event loop); a request's path crosses one such hop, router → worker (the "
                  "gateway → Redis → router legs and the spans to costd are not on it):", "",
                  "| call | plaintext p50 (µs) | mTLS p50 (µs) | added, median of pairs (µs) |",
                  "|---|---|---|---|"]
        lines += [f"| {name} | {r['plain_us']:.0f} | {r['tls_us']:.0f} | {r['added_us']:+.0f} |"
                  for name, r in hop.items()]
    if result.get("fronts"):
        lines += ["", "## The HTTP front over the gRPC front (judged)", "",
                  "Issue 17's row. `bench.fronts`, in the same run: the real gateway (both doors, "
                  "one process), Redis and costd, with this process as router and worker "
                  "(it answers each queued request from its result stream at once and notes when "
                  "it wrote each token; the client notes when each arrives, same clock). The "
                  "engine and its noise are out of the reading; what is left is each front's "
                  "path.", "", *fronts.report_lines(result["fronts"])]
    h = result.get("http_summary")
    if h:
        lines += ["", "## The HTTP front over the gRPC front, through the whole mesh (context)", "",
                  "The same mesh, the same run: each round also sends one request through the "
                  "gateway's OpenAI-compatible HTTP front (`POST /v1/chat/completions`, SSE, httpx "
                  "as client) and the three go in random order. \"added\" is the median of the "
                  "per-round differences HTTP − gRPC, both measured at the client (each client "
                  f"library's own cost included). Issue 17 target: ≤ {TARGET_HTTP_TTFT_MS:g} ms "
                  f"added p50 TTFT, ≤ {TARGET_HTTP_TPOT_MS:g} ms added per token. The last row "
                  "takes each request's prefill device time out (the HTTP request's from costd's "
                  "ledger, by its x-request-id): the fronts' own cost without the prefill's noise.", "",
                  "| metric | HTTP p50 (ms) | gRPC p50 (ms) | added, median of rounds (ms) | q1 – q3 (ms) | |",
                  "|---|---|---|---|---|---|"]
        for metric, name in (("ttft_s", "TTFT"), ("tpot_s", "time per output token"),
                             ("ttft_outside_engine_s", "TTFT outside the engine")):
            m = h.get(metric)
            if m is None:
                continue
            added = m["added_p50"] * 1e3
            # Not judged here: the prefill's noise (the q1 – q3 span) is ten times the target.
            verdict = "(diagnostic)" if metric == "ttft_outside_engine_s" else "(context)"
            lines.append(f"| {name} | {m['mesh_p50'] * 1e3:.2f} | {m['direct_p50'] * 1e3:.2f} | "
                         f"{added:+.3f} | {m['added_q1'] * 1e3:+.3f} – {m['added_q3'] * 1e3:+.3f} | "
                         f"{verdict} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.overhead")
    p.add_argument("--pairs", type=int, default=60)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--worker-args", default="", help="extra worker flags, one string")
    p.add_argument("--front-rounds", type=int, default=200,
                   help="rounds of bench.fronts (HTTP vs gRPC front, engine out); 0 = skip")
    p.add_argument("--tls-pairs", type=int, default=500,
                   help="plaintext/mTLS call pairs on one warm hop (bench.tls_hop); 0 = skip")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    command = "python -m bench.overhead " + " ".join(sys.argv[1:] if argv is None else argv)
    env = environment()
    result = asyncio.run(measure(args.pairs, args.seed, args.worker_args.split()))
    if args.front_rounds:
        result["fronts"] = asyncio.run(fronts.measure(rounds=args.front_rounds, seed=args.seed))
    if args.tls_pairs:   # what the locks cost: mutual TLS on one warm internal hop, same run
        result["tls_hop"] = asyncio.run(tls_hop.measure(args.tls_pairs))
    result["summary"] = summarise(result["pairs"])
    result["http_summary"] = summarise(result["pairs"], over="http", base="mesh")
    result["environment"], result["command"] = env, command.strip()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead-paired.json").write_text(json.dumps(result, indent=1))
    text = report(result, command.strip(), env)
    (out / "overhead-paired.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
