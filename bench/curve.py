"""The throughput-vs-concurrency curve costd's what-if reads (format: costd/whatif/curve.py),
from a closed-loop run against our worker.

Rates come from the device seconds the worker attributed (each engine step's time shared by
the tokens in it): prompt tokens computed / prefill seconds and completion tokens / decode
seconds — the same split costd bills and the what-if model divides by.
"""
from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from llmmesh.models import DEFAULT_MODEL

FORMAT = "llmmesh.throughput-curve/v1"
CURVES_DIR = Path(__file__).resolve().parent / "curves"


def _point(level: dict) -> dict | None:
    s = level["summaries"]["all"]
    uncached = s["prompt_tokens"] - s["cached_prompt_tokens"]
    prefill_s, decode_s = s["prefill_device_s"], s["decode_device_s"]
    if not s["num_ok"] or not prefill_s or not decode_s or uncached <= 0:
        return None
    point = {"concurrency": level["concurrency"],
             "prefill_tokens_per_s": round(uncached / prefill_s, 2),
             "decode_tokens_per_s": round(s["completion_tokens"] / decode_s, 2)}
    if s["ttft"]:
        point["p95_ttft_s"] = round(s["ttft"]["p95"], 4)
    if s["tpot"]:
        point["p95_tpot_s"] = round(s["tpot"]["p95"], 5)
    return point


def build_curve(results: dict, target: str) -> dict | None:
    """The curve of one target's closed-loop levels, or None when it has no device seconds."""
    data = results["targets"].get(target)
    loop = results["profile"].get("closed_loop")
    if not data or not loop or not loop["curve_name"]:
        return None
    levels = [lv for lv in data["levels"] if lv["concurrency"] is not None]
    points = [p for p in map(_point, levels) if p is not None]
    if not points:
        return None
    done = [lv["summaries"]["all"] for lv in levels if lv["summaries"]["all"]["num_ok"]]
    prompt = sum(s["prompt_tokens"] for s in done) / sum(s["num_ok"] for s in done)
    completion = sum(s["completion_tokens"] for s in done) / sum(s["num_ok"] for s in done)
    when = dt.datetime.fromtimestamp(results["started_unix_s"], dt.timezone.utc)
    device = data.get("device_type") or "cpu"
    # The profile's name is the CPU curve's; another device gets its own file, not that one.
    name = loop["curve_name"] if device == "cpu" else \
        device.lower().replace(":", "-") + "-" + loop["curve_name"].split("-", 1)[-1]
    return {"format": FORMAT, "name": name, "device_type": device, "model": DEFAULT_MODEL,
            "quantization": data.get("quantization") or "none",
            "measured": {"command": results["command"], "date": f"{when:%Y-%m-%d}",
                         "target": target, "machine": results["environment"]["machine"],
                         # > the CPU count: other work shared the host and slowed this curve
                         "load_average": results["environment"]["load_average_at_start"],
                         "prompt_tokens": round(prompt, 1), "completion_tokens": round(completion, 1)},
            "points": points}


def write_curve(results: dict, curves_dir: Path = CURVES_DIR) -> Path | None:
    """Writes <curve_name>.json from the worker (else the mesh); checks it parses as costd will,
    since costd refuses to start on a bad curve file."""
    curve = next((c for c in (build_curve(results, t) for t in ("worker", "mesh")) if c), None)
    if curve is None:
        return None
    text = json.dumps(curve, indent=2) + "\n"
    try:
        from costd.whatif.curve import parse_curve
    except ImportError:
        parse_curve = None
    if parse_curve is not None:
        parse_curve(text, curve["name"])
    curves_dir.mkdir(parents=True, exist_ok=True)
    path = curves_dir / f"{curve['name']}.json"
    path.write_text(text)
    return path
