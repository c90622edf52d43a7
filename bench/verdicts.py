"""Issue 6's targets, computed from one run's results as ratios between its targets and levels.

They are reported, never asserted: a run on a busy or different machine still produces them.
"""
from __future__ import annotations

OVERHEAD_TTFT_MS, OVERHEAD_TPOT_MS = 5.0, 0.5
CAPACITY_RATIO = 2.0
MIXED_RATIO = 1.5


def _p(summary: dict | None, metric: str, pct: str = "p50") -> float | None:
    d = summary and summary.get(metric)
    return d[pct] if d else None


def _open_levels(data: dict) -> list[dict]:
    return [lv for lv in data["levels"] if lv["concurrency"] is None and not lv["streams"]]


def overhead(results: dict) -> list[str]:
    """What the gateway, Redis queue and router add over the worker called directly."""
    mesh, worker = results["targets"].get("mesh"), results["targets"].get("worker")
    if not mesh or not worker:
        return []
    rows = ["### Mesh overhead vs the worker called directly",
            f"Target: ≤ {OVERHEAD_TTFT_MS:g} ms added p50 TTFT, ≤ {OVERHEAD_TPOT_MS:g} ms "
            "added per token (p50 TPOT). The lowest load is the clean reading: higher loads add "
            "the queueing both see.", "",
            "| load | p50 TTFT mesh / worker (ms) | added | p50 TPOT mesh / worker (ms) | added |",
            "|---|---|---|---|---|"]
    by_label = {lv["label"]: lv for lv in worker["levels"]}
    for lv in mesh["levels"]:
        other = by_label.get(lv["label"])
        if other is None:
            continue
        m, w = lv["summaries"]["all"], other["summaries"]["all"]
        cells = []
        for metric, limit in (("ttft", OVERHEAD_TTFT_MS), ("tpot", OVERHEAD_TPOT_MS)):
            a, b = _p(m, metric), _p(w, metric)
            if a is None or b is None:
                cells += ["–", "–"]
                continue
            added = (a - b) * 1e3
            cells += [f"{a * 1e3:.1f} / {b * 1e3:.1f}",
                      f"{added:+.1f} {'✅' if added <= limit else '❌'}"]
        rows.append(f"| {lv['label']} | " + " | ".join(cells) + " |")
    return rows + [""]


def max_rate_meeting(data: dict, slo_ttft_s: float) -> tuple[float | None, bool]:
    """Highest offered load whose interactive p95 TTFT meets the SLO with no failed request;
    and whether even the highest level met it (then the capacity is only a lower bound)."""
    best, levels = None, _open_levels(data)
    for lv in levels:
        s = lv["summaries"].get("interactive")
        p95 = _p(s, "ttft", "p95")
        if s and p95 is not None and p95 <= slo_ttft_s and s["num_ok"] == s["num_requests"]:
            best = max(best or 0.0, lv["offered_rps"])
    return best, bool(levels) and best == max(lv["offered_rps"] for lv in levels)


def capacity(results: dict) -> list[str]:
    slo = results["profile"]["slo"].get("interactive")
    targets = results["targets"]
    if not slo or max(len(_open_levels(d)) for d in targets.values()) < 2:
        return []
    rows = [f"### Load sustained at p95 TTFT ≤ {slo['ttft_s']:g} s (interactive)",
            f"Target: llmmesh ≥ {CAPACITY_RATIO:g}× llama-server's rate.", ""]
    rates = {}
    for name, data in targets.items():
        rate, capped = max_rate_meeting(data, slo["ttft_s"])
        rates[name] = rate
        text = "met at no level" if rate is None else \
            f"{rate:.3g} req/s" + (" (met at the highest level: a lower bound)" if capped else "")
        rows.append(f"- {name}: {text}")
    ours, peer = rates.get("mesh"), rates.get("llamacpp")
    if "mesh" in rates and "llamacpp" in rates:
        if ours and peer:
            ratio = ours / peer
            rows.append(f"- ratio mesh / llama-server: **{ratio:.2f}×** "
                        f"{'✅' if ratio >= CAPACITY_RATIO else '❌'} (sweep granularity: "
                        "the levels run)")
        else:
            rows.append("- ratio mesh / llama-server: not defined at these levels "
                        "(one of them met the SLO at none)")
    return rows + [""]


def mixed(results: dict) -> list[str]:
    alone = results["profile"].get("alone")
    if not alone:
        return []
    rows = [f"### Interactive p95 TTFT mixed vs `{alone}` alone",
            f"Target: mixed ≤ {MIXED_RATIO:g}× alone (same arrivals of the interactive stream).",
            "", "| target | level | alone p95 TTFT (s) | mixed p95 TTFT (s) | ratio |",
            "|---|---|---|---|---|"]
    for name, data in results["targets"].items():
        levels = {lv["label"]: lv for lv in data["levels"]}
        for lv in data["levels"]:
            base = levels.get(f"{alone} alone {lv['label']}")
            if base is None:
                continue
            a = _p(base["summaries"].get("interactive"), "ttft", "p95")
            m = _p(lv["summaries"].get("interactive"), "ttft", "p95")
            if a and m:
                ok = "✅" if m / a <= MIXED_RATIO else "❌"
                rows.append(f"| {name} | {lv['label']} | {a:.3f} | {m:.3f} | {m / a:.2f}× {ok} |")
    return rows + [""]


def verdicts(results: dict) -> list[str]:
    body = overhead(results) + capacity(results) + mixed(results)
    return (["## Issue 6 targets, as measured in this run", ""] + body) if body else []
