"""What-if inputs: a traffic profile and a scenario, validated frozen values.

Profile JSON (`llmmesh whatif --profile FILE`):

    {"requests_per_s_by_hour": [2.0, 1.5, …],        # one value per hour; 24 = a day
     "prompt_tokens": [[256, 0.7], [2048, 0.3]],      # [tokens, weight] pairs, or one number
     "completion_tokens": 128,
     "prefix_hit_rate": 0.25}                         # share of prompt tokens cached, 0..1
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal


@dataclass(frozen=True, slots=True)
class Lengths:
    """A length distribution: (tokens, weight) buckets."""

    buckets: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.buckets:
            raise ValueError("a length distribution needs at least one bucket")
        for tokens, weight in self.buckets:
            if not (math.isfinite(tokens) and tokens >= 0 and math.isfinite(weight)
                    and weight >= 0):
                raise ValueError(f"bad bucket ({tokens}, {weight}): both must be >= 0")
        if sum(w for _, w in self.buckets) <= 0:
            raise ValueError("a length distribution's weights must not all be 0")

    @classmethod
    def of(cls, value: object) -> Lengths:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return cls(((float(value), 1.0),))
        if isinstance(value, (list, tuple)):
            return cls(tuple((float(t), float(w)) for t, w in value))
        raise ValueError(f"lengths must be a number or [tokens, weight] pairs, got {value!r}")

    @property
    def mean(self) -> float:
        total = sum(w for _, w in self.buckets)
        return sum(t * w for t, w in self.buckets) / total

    @property
    def p95(self) -> float:
        total = sum(w for _, w in self.buckets)
        seen = 0.0
        for tokens, weight in sorted(self.buckets):
            seen += weight
            if seen >= 0.95 * total:
                return tokens
        return max(t for t, _ in self.buckets)

    def scaled(self, factor: float) -> Lengths:
        return Lengths(tuple((t * factor, w) for t, w in self.buckets))


@dataclass(frozen=True, slots=True)
class TrafficProfile:
    requests_per_s_by_hour: tuple[float, ...]
    prompt_tokens: Lengths
    completion_tokens: Lengths
    prefix_hit_rate: float = 0.0

    def __post_init__(self) -> None:
        if not self.requests_per_s_by_hour:
            raise ValueError("requests_per_s_by_hour needs at least one hour")
        if any(not math.isfinite(r) or r < 0 for r in self.requests_per_s_by_hour):
            raise ValueError("requests_per_s_by_hour values must be >= 0")
        if not 0 <= self.prefix_hit_rate <= 1:
            raise ValueError(f"prefix_hit_rate must be in [0, 1], got {self.prefix_hit_rate}")

    @classmethod
    def from_json(cls, data: dict) -> TrafficProfile:
        return cls(tuple(float(r) for r in data["requests_per_s_by_hour"]),
                   Lengths.of(data["prompt_tokens"]), Lengths.of(data["completion_tokens"]),
                   float(data.get("prefix_hit_rate", 0.0)))


@dataclass(frozen=True, slots=True)
class Scenario:
    device: str
    price_per_hour: Decimal | None = None  # None: the price book's
    quantization: str = ""  # "": any curve of the device
    max_batch: int = 0  # 0: the curve's largest concurrency
    prompt_length_change_pct: float = 0.0
    max_devices: int = 0  # 0: no limit
    target_utilisation: float = 1.0
    autoscale: bool = False
    p95_latency_slo_s: float = 0.0  # 0: none

    def __post_init__(self) -> None:
        if not self.device:
            raise ValueError("scenario.device is required")
        if self.price_per_hour is not None and (not self.price_per_hour.is_finite()
                                                or self.price_per_hour < 0):
            raise ValueError("scenario.price_per_hour must be >= 0")
        if self.max_batch < 0 or self.max_devices < 0:
            raise ValueError("scenario.max_batch and max_devices must be >= 0")
        if not -100 < self.prompt_length_change_pct <= 1000:
            raise ValueError("scenario.prompt_length_change_pct must be in (-100, 1000]")
        if not 0 < self.target_utilisation <= 1:
            raise ValueError("scenario.target_utilisation must be in (0, 1]")
        if not math.isfinite(self.p95_latency_slo_s) or self.p95_latency_slo_s < 0:
            raise ValueError("scenario.p95_latency_slo_s must be >= 0")
