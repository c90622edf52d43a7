"""The Markdown report of a run (bench/results/<profile>.md): how it was made, the issue's target
ratios as measured, and per-level tables of latency, throughput, cache and cost."""
from __future__ import annotations

import datetime as dt
from pathlib import Path

from bench.plots import write_plots


def _s(d: dict | None, key: str, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    return fmt.format(d[key] * scale) if d and d.get(key) is not None else "–"


def _pcts(d: dict | None, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    return " / ".join(_s(d, k, scale, fmt) for k in ("p50", "p95", "p99"))


def _money(x: float | None) -> str:
    return "–" if x is None else f"{x:.4f}"


def _header(results: dict) -> list[str]:
    p, env = results["profile"], results["environment"]
    when = dt.datetime.fromtimestamp(results["started_unix_s"], dt.timezone.utc)
    lines = [f"# Bench: {p['name']}", "", p["description"], "",
             f"- command: `{results['command']}`",
             f"- measured: {when:%Y-%m-%d %H:%M} UTC on {env['machine']}; load average at start "
             f"{env['load_average_at_start']}",
             f"- versions: Python {env['python']}, "
             + ", ".join(f"{k} {v}" for k, v in env["versions"].items())
             + f"; commit {env['commit']}",
             f"- duration {p['duration_s']:g} s per level (drain ≤ {p['drain_s']:g} s), "
             f"scale ×{p['scale']:g}, seed {p['seed']}",
             "- SLO (goodput counts requests meeting both): "
             + "; ".join(f"{c} TTFT ≤ {v['ttft_s']:g} s and TPOT ≤ {v['tpot_s']:g} s"
                         for c, v in p["slo"].items()), "", "Targets, one after another:", ""]
    lines += [f"- **{name}**: {data['describe']}"
              + (f" — **failed: {data['error']}**" if data.get("error") else "")
              for name, data in results["targets"].items()]
    return lines + [""]


def _streams(p: dict) -> list[str]:
    if p.get("closed_loop"):
        c = p["closed_loop"]
        levels = ", ".join(str(n) for n in c["concurrency"])
        return [f"Closed loop: concurrency {levels}, {c['requests_per_slot']} requests "
                f"per slot, {c['prompt_tokens']} prompt → {c['completion_tokens']} completion "
                "tokens (greedy; a request may stop early at end-of-sequence).", ""]
    rows = ["| stream | tenant | class | rate (req/s, before sweep) | prompt tokens | "
            "completion tokens | shared system prompt |", "|---|---|---|---|---|---|---|"]
    for s in p["streams"]:
        shape = " (diurnal: 24 hourly multipliers)" if s["hourly"] else ""
        rows.append(f"| {s['name']} | {s['tenant']} | {s['request_class']} | "
                    f"{s['rate_rps'] * p['scale']:g}{shape} | {s['prompt_tokens'][0]}–"
                    f"{s['prompt_tokens'][1]} | {s['completion_tokens'][0]}–"
                    f"{s['completion_tokens'][1]} | {s['system_prompt_tokens']} tokens |")
    return rows + ["", f"Sweep factors: {p['rates']}" + (f"; stream `{p['alone']}` is also "
                   "replayed alone with the same arrivals" if p["alone"] else ""), ""]


def _load(level: dict) -> str:
    if level["concurrency"] is not None:
        return f"c={level['concurrency']}"
    return f"{level['label']} ({level['offered_rps']:.3g} req/s)"


def _tenants(level: dict) -> dict[str, set]:
    by_class: dict[str, set] = {}
    for request in level["requests"]:
        by_class.setdefault(request[0], set()).add(request[1])
    return by_class


def _rows(level: dict):
    """(label, summary, whole run?, tenant) per row: a run of one class is one row named by
    it; a class of one tenant is labelled with it."""
    summaries, tenants = level["summaries"], _tenants(level)
    if len(summaries) == 2:
        cls = next(g for g in summaries if g != "all")
        yield cls, summaries["all"], True, _only(tenants.get(cls))
        return
    for group, s in summaries.items():
        tenant = group.split("/")[0] if "/" in group else _only(tenants.get(group))
        label = f"{group} ({tenant})" if tenant and "/" not in group else group
        yield label, s, group == "all", tenant


def _only(tenants: set | None) -> str:
    return next(iter(tenants)) if tenants and len(tenants) == 1 else ""


def _latency_table(results: dict) -> list[str]:
    rows = ["## Latency (seconds; TPOT in ms) — p50 / p95 / p99", "",
            "| target | load | group | ok / sent | TTFT | TPOT (ms) | end-to-end | queue wait |",
            "|---|---|---|---|---|---|---|---|"]
    for target, data in results["targets"].items():
        for level in data["levels"]:
            for group, s, _, _ in _rows(level):
                rows.append(f"| {target} | {_load(level)} | {group} | {s['num_ok']} / "
                            f"{s['num_requests']} | {_pcts(s['ttft'])} | "
                            f"{_pcts(s['tpot'], 1e3, '{:.1f}')} | {_pcts(s['e2e'])} | "
                            f"{_pcts(s['queue'])} |")
    return rows + [""]


def _throughput_table(results: dict) -> list[str]:
    rows = ["## Throughput, cache, load and cost", "",
            "| target | load | group | output tok/s | req/s | goodput req/s (SLO met) | "
            "prefix-cache hit | KV used mean / max | running mean | $/1M tok wall | "
            "$/1M tok device | $/1M tok costd |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for target, data in results["targets"].items():
        for level in data["levels"]:
            for group, s, whole, tenant in _rows(level):
                rows.append(_throughput_row(target, level, group, s, whole, tenant))
    return rows + [""]


def _throughput_row(target: str, level: dict, group: str, s: dict, whole: bool,
                    tenant: str) -> str:
    cost, load = level["cost"], level["load"]
    attain = f" ({s['slo_attainment']:.0%})" if s["slo_attainment"] is not None else ""
    hit = f"{s['prefix_hit_rate']:.0%}" if s["prefix_hit_rate"] is not None else "–"
    kv = (f"{load['kv_usage']['mean']:.0%} / {load['kv_usage']['max']:.0%}"
          if whole and "kv_usage" in load else "–")
    running = f"{load['running']['mean']:.1f}" if whole and "running" in load else "–"
    costd = cost.get("costd")
    billed = None if not costd else (costd["tenants"].get(tenant) if tenant
                                     else costd["per_1m"] if whole else None)
    return (f"| {target} | {_load(level)} | {group} | {s['output_tok_s']:.1f} | "
            f"{s['request_rps']:.3f} | {s['goodput_rps']:.3f}{attain} | {hit} | {kv} | "
            f"{running} | {_money(cost['wall_per_1m']) if whole else '–'} | "
            f"{_money(cost['device_per_1m']) if whole else '–'} | {_money(billed)} |")


def _errors(results: dict) -> list[str]:
    rows = []
    for target, data in results["targets"].items():
        for level in data["levels"]:
            errs = level["summaries"]["all"]["errors"]
            if errs:
                rows.append(f"- {target} {level['label']}: "
                            + ", ".join(f"{k} × {v}" for k, v in sorted(errs.items())))
            for warning in level["cost"].get("costd", {}).get("warnings", []):
                rows.append(f"- {target} {level['label']}: costd: {warning}")
            if level["max_send_lag_s"] > 0.05:
                rows.append(f"- {target} {level['label']}: the client sent up to "
                            f"{level['max_send_lag_s'] * 1e3:.0f} ms late (it was short of CPU)")
    return (["## Errors, warnings and client lag", "", *rows, ""]) if rows else []


NOTES = """## How to read this

- TTFT: request sent → first token received by the client. TPOT: (end-to-end − TTFT) /
  (completion tokens − 1), vLLM's benchmark_serving definition (immune to how tokens are
  chunked). Queue wait: what the worker reports (arrival at the worker → its first engine
  step); in the mesh the wait in the Redis queue before dispatch is not in it (it is in TTFT);
  llama-server reports none.
- Offered load is the mean arrival rate of the level (Poisson, open loop: arrivals never wait
  for the server). Throughput and goodput divide by the level's wall time (first arrival
  window to last completion).
- The p95 TTFT plot leaves out levels where under 90% of requests finished (failures and
  drain time-outs are listed under Errors).
- Prefix-cache hit: cached prompt tokens / prompt tokens. KV used: blocks held by requests /
  all blocks, sampled every 0.5 s (llama-server does not report it).
- $/1M tok (prompt + completion tokens) at the price book's device rate (config/prices.toml):
  *wall* = the machine for the level's wall time, busy or idle; *device* = the device seconds
  the engine attributed to requests; *costd* = the mesh's invoices for the level's window,
  as costd bills them (per tenant in tenant rows).
"""


def write_report(results: dict, out_dir: str | Path, verdicts: list[str]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(results, out)
    name = results["profile"]["name"]
    lines = _header(results) + _streams(results["profile"]) + verdicts
    lines += _latency_table(results) + _throughput_table(results) + _errors(results)
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + ["", NOTES]
    path = out / f"{name}.md"
    path.write_text("\n".join(lines))
    return path
