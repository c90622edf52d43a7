"""Throughput-vs-concurrency curves: what one device sustains at each batch size.

The benchmark harness writes one JSON file per device × model × quantization (shipped:
bench/curves/cpu-smollm2.json); costd reads every *.json in its curves directory. Format:

    {
      "format": "llmmesh.throughput-curve/v1",
      "name": "cpu-smollm2",                     # optional; defaults to the file's stem
      "device_type": "cpu",                      # as workers report llmmesh.device.type
      "model": "smollm2-135m-instruct",
      "quantization": "q4_1",                    # the worker's --quantization ("none", …)
      "measured": {                              # optional, for people and for latency scaling
        "command": "llmmesh bench …", "date": "2025-01-01",
        "prompt_tokens": 256, "completion_tokens": 64
      },
      "points": [                                # sorted by concurrency, at least one
        {"concurrency": 1,                       # requests in flight on the device
         "prefill_tokens_per_s": 900.0,          # uncached prompt tokens/s, all requests together
         "decode_tokens_per_s": 25.0,            # completion tokens/s, all requests together
         "p95_ttft_s": 0.35,                     # optional: measured p95 time to first token
         "p95_tpot_s": 0.045},                   # optional: measured p95 time per output token
        …
      ]
    }

A point may give `tokens_per_s` instead of the prefill/decode pair when only a blended rate is
known (the seed's case study: 600 tok/s); it then stands for both. Between points throughput
is linear in concurrency; below the first it falls linearly to 0 at concurrency 0; beyond the
last it is never extrapolated.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

FORMAT = "llmmesh.throughput-curve/v1"


@dataclass(frozen=True, slots=True)
class CurvePoint:
    concurrency: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    p95_ttft_s: float | None = None
    p95_tpot_s: float | None = None

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")


@dataclass(frozen=True, slots=True)
class ThroughputCurve:
    name: str
    device_type: str
    model: str
    quantization: str
    points: tuple[CurvePoint, ...]
    measured_prompt_tokens: float | None = None

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError(f"curve {self.name!r} has no points")
        levels = [p.concurrency for p in self.points]
        if levels != sorted(set(levels)):
            raise ValueError(f"curve {self.name!r}: concurrencies must be distinct and sorted")

    @property
    def max_concurrency(self) -> int:
        return self.points[-1].concurrency

    def at(self, concurrency: int) -> CurvePoint:
        """The curve at an integer concurrency ≤ max_concurrency (linear in between)."""
        if concurrency > self.max_concurrency:
            raise ValueError(f"concurrency {concurrency} is beyond the curve")
        first = self.points[0]
        if concurrency < first.concurrency:  # towards (0, 0); latency as first measured
            share = concurrency / first.concurrency
            return CurvePoint(concurrency, first.prefill_tokens_per_s * share,
                              first.decode_tokens_per_s * share, first.p95_ttft_s,
                              first.p95_tpot_s)
        for low, high in zip(self.points, self.points[1:]):
            if low.concurrency < concurrency < high.concurrency:
                return _between(low, high, concurrency)
        return next(p for p in self.points if p.concurrency == concurrency)


def _between(low: CurvePoint, high: CurvePoint, concurrency: int) -> CurvePoint:
    share = (concurrency - low.concurrency) / (high.concurrency - low.concurrency)

    def mix(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a + (b - a) * share

    return CurvePoint(concurrency, mix(low.prefill_tokens_per_s, high.prefill_tokens_per_s),
                      mix(low.decode_tokens_per_s, high.decode_tokens_per_s),
                      mix(low.p95_ttft_s, high.p95_ttft_s), mix(low.p95_tpot_s, high.p95_tpot_s))


def _point(item: dict) -> CurvePoint:
    blended = item.get("tokens_per_s")
    return CurvePoint(
        concurrency=int(item["concurrency"]),
        prefill_tokens_per_s=float(item.get("prefill_tokens_per_s", blended)),
        decode_tokens_per_s=float(item.get("decode_tokens_per_s", blended)),
        p95_ttft_s=item.get("p95_ttft_s"), p95_tpot_s=item.get("p95_tpot_s"))


def parse_curve(text: str, default_name: str = "inline") -> ThroughputCurve:
    try:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"format must be {FORMAT!r}, got {data.get('format')!r}")
        measured = data.get("measured") or {}
        return ThroughputCurve(
            name=str(data.get("name") or default_name), device_type=str(data["device_type"]),
            model=str(data.get("model", "")), quantization=str(data.get("quantization", "")),
            points=tuple(_point(p) for p in data["points"]),
            measured_prompt_tokens=measured.get("prompt_tokens"))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"curve {default_name}: {error}") from error


def load_curves(directory: str | Path) -> list[ThroughputCurve]:
    """Every curve in the directory, by file name; a missing directory has none."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return [parse_curve(path.read_text(), path.stem) for path in sorted(root.glob("*.json"))]
