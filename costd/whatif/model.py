"""The what-if model: profile × scenario × curve → cost per 1M tokens, devices, utilisation, p95.

A request's device time at concurrency c is uncached_prompt / prefill_rate(c) +
completion / decode_rate(c) — the same sharing the worker bills by — so one device carries
c-independent demand of `1 / device_time` requests per second. Each hour needs
ceil(busy device-seconds per second / target utilisation) devices; a fixed fleet runs the peak
hour's count all day, an autoscaled one follows each hour. Cost per 1M tokens is total cost /
total tokens over the profile: hours weigh by their tokens, never as a plain average of
hourly rates. The p95 latency is the service time at c (measured p95 TTFT/TPOT when the curve
has them); queueing beyond the target utilisation's headroom is not modelled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

from costd.costmodel import MICRO
from costd.whatif.curve import ThroughputCurve
from costd.whatif.profile import Scenario, TrafficProfile

_FUZZ = 1e-9  # float noise must not buy a whole extra device


@dataclass(frozen=True, slots=True)
class HourResult:
    hour: int
    requests_per_s: float
    tokens_per_s: float
    devices: int
    utilisation: float
    cost: Decimal


@dataclass(frozen=True, slots=True)
class WhatIfResult:
    feasible: bool
    reasons: tuple[str, ...]
    cost_per_million_tokens: Decimal | None
    prompt_cost_per_million_tokens: Decimal | None
    completion_cost_per_million_tokens: Decimal | None
    cost_per_million_tokens_at_full_utilisation: Decimal
    cost: Decimal
    devices_needed: int
    device_hours: int
    utilisation: float
    p95_latency_s: float
    concurrency: int
    tokens_per_s_per_device: float
    tokens: float
    curve: str
    hours: tuple[HourResult, ...]
    device_s_per_request: float  # at `concurrency`: busy device-s per second = rps × this


@dataclass(frozen=True, slots=True)
class _Request:
    """The profile's mean and p95 request under the scenario."""

    prompt: float
    uncached_prompt: float
    completion: float
    uncached_prompt_p95: float
    completion_p95: float


def _request(profile: TrafficProfile, scenario: Scenario) -> _Request:
    prompt = profile.prompt_tokens.scaled(1 + scenario.prompt_length_change_pct / 100)
    uncached = 1 - profile.prefix_hit_rate
    return _Request(prompt.mean, prompt.mean * uncached, profile.completion_tokens.mean,
                    prompt.p95 * uncached, profile.completion_tokens.p95)


def p95_latency_s(curve: ThroughputCurve, concurrency: int, request: _Request) -> float:
    point = curve.at(concurrency)
    if point.p95_ttft_s is not None and point.p95_tpot_s is not None:
        scale = (request.uncached_prompt_p95 / curve.measured_prompt_tokens
                 if curve.measured_prompt_tokens else 1.0)
        return point.p95_ttft_s * scale + request.completion_p95 * point.p95_tpot_s
    return (request.uncached_prompt_p95 * concurrency / point.prefill_tokens_per_s
            + request.completion_p95 * concurrency / point.decode_tokens_per_s)


def _concurrency(curve: ThroughputCurve, scenario: Scenario, request: _Request,
                 reasons: list[str]) -> tuple[int, bool]:
    """The batch to run at, and whether it meets the latency target."""
    limit = curve.max_concurrency
    if scenario.max_batch > limit:
        reasons.append(f"curve {curve.name} was measured up to concurrency {limit}; "
                       f"max_batch {scenario.max_batch} is not extrapolated")
    elif scenario.max_batch:
        limit = scenario.max_batch
    if not scenario.p95_latency_slo_s:
        return limit, True
    for concurrency in range(limit, 0, -1):
        if p95_latency_s(curve, concurrency, request) <= scenario.p95_latency_slo_s:
            return concurrency, True
    reasons.append(f"no concurrency meets p95 latency <= {scenario.p95_latency_slo_s} s "
                   f"(at 1 it is {p95_latency_s(curve, 1, request):.3f} s)")
    return 1, False


def _hours(profile: TrafficProfile, scenario: Scenario, device_s_per_request: float,
           tokens_per_request: float, price: Decimal) -> list[HourResult]:
    busy = [rps * device_s_per_request for rps in profile.requests_per_s_by_hour]
    needed = [math.ceil(b / scenario.target_utilisation - _FUZZ) for b in busy]
    fleet = max(needed)
    hours = []
    for hour, (rps, load, need) in enumerate(zip(profile.requests_per_s_by_hour, busy, needed)):
        running = need if scenario.autoscale else fleet
        hours.append(HourResult(hour, rps, rps * tokens_per_request, running,
                                load / running if running else 0.0, price * running))
    return hours


def what_if(profile: TrafficProfile, scenario: Scenario, curve: ThroughputCurve,
            price_per_hour: Decimal) -> WhatIfResult:
    request = _request(profile, scenario)
    reasons: list[str] = []
    concurrency, meets_latency = _concurrency(curve, scenario, request, reasons)
    point = curve.at(concurrency)
    prefill_s = request.uncached_prompt / point.prefill_tokens_per_s
    decode_s = request.completion / point.decode_tokens_per_s
    device_s = prefill_s + decode_s
    tokens_per_request = request.prompt + request.completion
    if device_s <= 0 or tokens_per_request <= 0:
        raise ValueError("the profile's requests have no tokens")
    per_device = tokens_per_request / device_s
    hours = _hours(profile, scenario, device_s, tokens_per_request, price_per_hour)
    needed = max(h.devices for h in hours)
    feasible = meets_latency
    if scenario.max_devices and needed > scenario.max_devices:
        feasible = False
        peak = max(hours, key=lambda h: h.tokens_per_s)
        reasons.append(
            f"infeasible: the peak hour needs {needed} devices ({peak.tokens_per_s:,.0f} tok/s "
            f"at {per_device:,.0f} tok/s per device, utilisation <= "
            f"{scenario.target_utilisation:g}); only {scenario.max_devices} available")
    cost = sum((h.cost for h in hours), Decimal(0))
    tokens = sum(h.tokens_per_s for h in hours) * 3600
    prompt_tokens = tokens * request.prompt / tokens_per_request
    busy_s = sum(h.requests_per_s for h in hours) * 3600 * device_s
    device_hours = sum(h.devices for h in hours)
    prompt_cost = cost * Decimal(prefill_s / device_s)
    return WhatIfResult(
        feasible=feasible, reasons=tuple(reasons),
        cost_per_million_tokens=per_million(cost, tokens),
        prompt_cost_per_million_tokens=per_million(prompt_cost, prompt_tokens),
        completion_cost_per_million_tokens=per_million(cost - prompt_cost, tokens - prompt_tokens),
        cost_per_million_tokens_at_full_utilisation=per_million(price_per_hour, per_device * 3600),
        cost=cost, devices_needed=needed, device_hours=device_hours,
        utilisation=busy_s / (device_hours * 3600) if device_hours else 0.0,
        p95_latency_s=p95_latency_s(curve, concurrency, request), concurrency=concurrency,
        tokens_per_s_per_device=per_device, tokens=tokens, curve=curve.name,
        hours=tuple(hours), device_s_per_request=device_s)


def per_million(cost: Decimal, tokens: float) -> Decimal | None:
    if tokens <= 0:
        return None
    return (cost * 1_000_000 / Decimal(repr(tokens))).quantize(MICRO)
