"""Summaries of one level: latency percentiles (HdrHistogram), throughput, goodput, cache, load.

Groups: every request, each class, and each tenant × class — what a tenant feels is not what
the fleet averages to.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from hdrh.histogram import HdrHistogram

from bench.loadgen import Outcome
from bench.profile import Slo

_US = 1e6  # histograms hold microseconds: 1 µs .. 1 h at 3 significant digits


@dataclass(frozen=True, slots=True)
class Dist:
    n: int
    mean: float
    p50: float
    p95: float
    p99: float


def dist(values_s: list[float]) -> Dist | None:
    if not values_s:
        return None
    hist = HdrHistogram(1, 3600 * int(_US), 3)
    for v in values_s:
        hist.record_value(max(1, min(int(v * _US), 3600 * int(_US))))
    # The exact mean: HdrHistogram's walks every bucket in Python (~0.1 s a call).
    return Dist(len(values_s), sum(values_s) / len(values_s),
                *(hist.get_value_at_percentile(p) / _US for p in (50, 95, 99)))


@dataclass(frozen=True, slots=True)
class Summary:
    group: str
    num_requests: int
    num_ok: int
    errors: dict
    ttft: Dist | None
    tpot: Dist | None
    e2e: Dist | None
    queue: Dist | None
    output_tok_s: float
    request_rps: float
    goodput_rps: float  # requests/s that finished within their class's SLO
    slo_attainment: float | None
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    prefill_device_s: float | None  # device seconds the engine attributed to requests
    decode_device_s: float | None

    @property
    def device_s(self) -> float | None:
        if self.prefill_device_s is None:
            return None
        return self.prefill_device_s + self.decode_device_s

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else None

    def to_dict(self) -> dict:
        return {**asdict(self), "prefix_hit_rate": self.prefix_hit_rate, "device_s": self.device_s}


def meets(outcome: Outcome, slo: Slo) -> bool:
    tpot = outcome.tpot_s
    return outcome.ok and outcome.ttft_s <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s)


def summarise(group: str, outcomes: list[Outcome], wall_s: float, slo: dict[str, Slo]) -> Summary:
    ok = [o for o in outcomes if o.ok]
    good = [o for o in ok if meets(o, slo[o.spec.request_class])]
    usage = [o.usage for o in ok]
    timed = [u for u in usage if "prefill_device_s" in u]
    queue = [u["queue_s"] for u in usage if "queue_s" in u]
    completion = sum(o.completion_tokens for o in ok)
    wall_s = max(wall_s, 1e-9)
    return Summary(
        group=group, num_requests=len(outcomes), num_ok=len(ok),
        errors=dict(Counter(o.error for o in outcomes if o.error)),
        ttft=dist([o.ttft_s for o in ok]),
        tpot=dist([t for t in (o.tpot_s for o in ok) if t is not None]),
        e2e=dist([o.e2e_s for o in ok]), queue=dist(queue),
        output_tok_s=completion / wall_s, request_rps=len(ok) / wall_s,
        goodput_rps=len(good) / wall_s,
        slo_attainment=len(good) / len(outcomes) if outcomes else None,
        prompt_tokens=sum(u.get("prompt_tokens", 0) for u in usage),
        cached_prompt_tokens=sum(u.get("cached_prompt_tokens", 0) for u in usage),
        completion_tokens=completion,
        prefill_device_s=sum(u["prefill_device_s"] for u in timed) if timed else None,
        decode_device_s=sum(u["decode_device_s"] for u in timed) if timed else None)


def groups(outcomes: list[Outcome]) -> dict[str, list[Outcome]]:
    """'all', then each class, then each tenant/class pair — the pairs only when they split a
    class (two tenants in one class), else they would repeat the class rows."""
    out = {"all": outcomes}
    classes = sorted({o.spec.request_class for o in outcomes})
    for cls in classes:
        out[cls] = [o for o in outcomes if o.spec.request_class == cls]
    pairs = sorted({(o.spec.tenant, o.spec.request_class) for o in outcomes})
    if len(pairs) > len(classes):
        for tenant, cls in pairs:
            out[f"{tenant}/{cls}"] = [o for o in outcomes
                                      if (o.spec.tenant, o.spec.request_class) == (tenant, cls)]
    return out


def load_summary(samples: list[dict]) -> dict:
    """Mean and peak of each sampled gauge (KV usage is a fraction of all blocks)."""
    out = {}
    for key in sorted({k for s in samples for k in s}):
        values = [s[key] for s in samples if key in s]
        out[key] = {"mean": sum(values) / len(values), "max": max(values)}
    return out
