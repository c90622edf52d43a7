"""PNG plots of a run (matplotlib, Agg: no display needed): latency CDFs per class, and
throughput and p95 TTFT against offered load (or concurrency) for every target."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

COLORS = {"mesh": "tab:blue", "worker": "tab:green", "llamacpp": "tab:red"}
_REQ_CLASS, _TTFT, _E2E, _COMPLETION, _SENT, _PROMPT = 0, 2, 4, 5, 7, 8


def _cdf(ax, values: list[float], **style) -> None:
    values = sorted(values)
    if values:
        ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", **style)


def latency_cdf(results: dict, request_class: str, path: Path) -> Path | None:
    """TTFT and end-to-end latency CDFs of one class: a line per target × level."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    drawn = False
    for target, data in results["targets"].items():
        levels = data["levels"]
        for i, level in enumerate(levels):
            rows = [r for r in level["requests"] if r[_REQ_CLASS] == request_class and r[_TTFT]]
            if not rows:
                continue
            style = {"color": COLORS.get(target), "alpha": 0.35 + 0.65 * (i + 1) / len(levels),
                     "label": f"{target} {level['label']}", "linewidth": 1.2}
            _cdf(axes[0], [r[_TTFT] for r in rows], **style)
            _cdf(axes[1], [r[_E2E] for r in rows], **style)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    for ax, what in zip(axes, ("time to first token (s)", "end-to-end latency (s)")):
        _log(ax, "x")
        ax.set_xlabel(what)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{results['profile']['name']}: {request_class} latency CDF")
    return _save(fig, path)


def _sweep_x(level: dict) -> float | None:
    return level["concurrency"] if level["concurrency"] is not None else level["offered_rps"]


def versus_load(results: dict, path: Path) -> Path | None:
    """Output tok/s and p95 TTFT against offered load; levels replaying part of the mix (the
    "alone" baseline) are left out so every point has the same traffic shape."""
    closed = results["profile"].get("closed_loop") is not None
    slo = results["profile"]["slo"]
    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    longest = 0
    for target, data in results["targets"].items():
        levels = [lv for lv in data["levels"] if not lv["streams"]]
        xs = [_sweep_x(lv) for lv in levels]
        summaries = [lv["summaries"]["all"] for lv in levels]
        # A p95 over the few requests that finished would flatter a collapsed level.
        ttft = [s["ttft"]["p95"] if s["ttft"] and s["num_ok"] >= 0.9 * s["num_requests"]
                else float("nan") for s in summaries]
        style = {"color": COLORS.get(target), "marker": "o", "label": target}
        ax_tp.plot(xs, [s["output_tok_s"] for s in summaries], **style)
        ax_ttft.plot(xs, ttft, **style)
        longest = max(longest, len(xs))
    if longest < 2:  # a single level has no curve to draw
        plt.close(fig)
        return None
    xlabel = "concurrency (requests in flight)" if closed else "offered load (requests/s)"
    ax_tp.set_ylabel("output tokens/s")
    ax_ttft.set_ylabel("p95 time to first token (s)")
    _log(ax_ttft, "y")
    if "interactive" in slo:
        ax_ttft.axhline(slo["interactive"]["ttft_s"], color="grey", linestyle="--",
                        label=f"SLO {slo['interactive']['ttft_s']:g} s")
    for ax in (ax_tp, ax_ttft):
        ax.set_xlabel(xlabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{results['profile']['name']}: throughput and p95 TTFT vs "
                 f"{'concurrency' if closed else 'offered load'}")
    return _save(fig, path)


def _hourly(level: dict, hour_s: float) -> list[list]:
    """The level's requests by compressed hour of their arrival."""
    hours = [[] for _ in range(24)]
    for r in level["requests"]:
        hours[min(int(r[_SENT] / hour_s), 23)].append(r)
    return hours


def _p95(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.95 * len(values)))] if values else float("nan")


def over_day(results: dict, path: Path) -> Path | None:
    """The compressed day, hour by hour: arrivals, p95 TTFT, and the machine's cost per 1M
    tokens (busy or idle, wall-time priced): off-peak hours pay for idle capacity."""
    p = results["profile"]
    if not any(s["hourly"] for s in p["streams"]):
        return None
    ran = {t: d["levels"][0] for t, d in results["targets"].items() if d["levels"]}
    if not ran:
        return None
    hour_s = p["duration_s"] / 24
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for target, level in ran.items():
        ttft = [_p95([r[_TTFT] for r in h if r[_TTFT]]) for h in _hourly(level, hour_s)]
        axes[1].plot(range(24), ttft, color=COLORS.get(target), marker=".", label=target)
    # Every target got the same requests: arrivals, and the cost per token of a machine that
    # is there all day (by hour of arrival), are one line each — the traffic's shape.
    level = next(iter(ran.values()))
    hours = _hourly(level, hour_s)
    offered = [sum(st["rate_rps"] * (st["hourly"][h] if st["hourly"] else 1.0)
                   for st in p["streams"]) * p["scale"] * level["factor"] for h in range(24)]
    axes[0].plot(range(24), offered, color="grey", linestyle="--", label="offered (profile)")
    axes[0].plot(range(24), [len(h) / hour_s for h in hours], color="black", marker=".",
                 label="drawn (every target)")
    tokens = [sum(r[_COMPLETION] + r[_PROMPT] for r in h) for h in hours]
    price_s = level["cost"]["price_per_hour"] / 3600
    axes[2].plot(range(24), [hour_s * price_s / t * 1e6 if t else float("nan") for t in tokens],
                 color="black", marker=".", label="one machine all day")
    labels = ("arrivals (requests/s)", "p95 time to first token (s)", "$ per 1M tokens (wall)")
    for ax, label in zip(axes, labels):
        ax.set_xlabel(f"hour of the compressed day ({hour_s:g} s each)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{p['name']}: through the day")
    return _save(fig, path)


def _log(ax, which: str) -> None:
    """Log scale labelled in plain numbers (0.5, 1, 2), not 5×10⁻¹."""
    getattr(ax, f"set_{which}scale")("log")
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    name = results["profile"]["name"]
    classes = sorted({r[_REQ_CLASS] for d in results["targets"].values()
                      for lv in d["levels"] for r in lv["requests"]})
    made = [latency_cdf(results, c, out_dir / f"{name}-{c}-cdf.png") for c in classes]
    made.append(versus_load(results, out_dir / f"{name}-vs-load.png"))
    made.append(over_day(results, out_dir / f"{name}-day.png"))
    return [p for p in made if p is not None]
