"""Consolidation what-if: k models sharing devices vs a device (or more) for each model.

Models file (`llmmesh whatif-consolidate --models FILE`), JSON:

    {"device_memory_mib": 24576,           # optional; --device-memory-mib overrides it
     "models": [
       {"name": "chat",
        "profile": {…},                     # a traffic profile (costd/whatif/profile.py); every
                                            # model's covers the same number of hours
        "curve": "cpu-smollm2",             # a curve's name in costd's curves directory, or
                                            # the curve itself (costd/whatif/curve.py) inline
        "memory_mib": 641,                  # what it holds while resident: weights + KV pool
        "load_s": 4.7,                      # measured load (cold start) time, seconds
        "pinned": false},                   # always resident on shared devices; default false
       …]}

Each model m runs at the concurrency c_m the one-model what-if (model.py) picks from ITS curve
(max batch, latency target), so its busy device-seconds per second in hour h are
B_m(h) = rps_m(h) × device_s_m(c_m). With u the target utilisation:

    dedicated  D(h) = Σ_m ⌈B_m(h) / u⌉                   (the per-model what-ifs, summed)
    shared     S(h) = ⌈Σ_m B_m(h) / (u − ℓ(h) / 3600)⌉   ℓ(h) = Σ load_s of models swapped in

A fixed fleet (no autoscale) runs each layout's peak count all day, per model when dedicated.
Every shared device holds the same resident set (models are replicated, not sharded), so every
running device spends ℓ(h) loading, which counts as busy time. Swaps follow residency.py:
pinned models are always resident and take their memory off the top; any other model stays
resident until memory is needed, least recently used evicted first; a model with demand that
is not resident is loaded once that hour; the profile repeats, so hour 0 starts with what the
last hour left. Cost = price × device-hours; cost per 1M tokens = cost / tokens over the
profile; a model's share of the shared cost is pro rata to its serving + loading
device-seconds. scenario.max_devices caps each layout's devices in any hour.

Left out: queueing (devices are sized by busy time over u); latency on a shared device, where
the models' batches interleave (worse than each model alone: its curve at the summed
concurrency); requests waiting for their model's turn in a contended hour; the cold start of
a device that autoscaling adds, or of a dedicated model scaling up from zero, in either layout;
sharding models across the pool's devices, which could beat replication when memory is short.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from decimal import Decimal

from costd.costmodel import MICRO
from costd.whatif.curve import ThroughputCurve
from costd.whatif.model import WhatIfResult, per_million, what_if
from costd.whatif.profile import Scenario, TrafficProfile
from costd.whatif.residency import Swaps, swaps

_FUZZ = 1e-9  # float noise must not buy a whole extra device, as in model.py


class FieldError(ValueError):
    """A bad input, naming the field (as the models file and the proto spell it)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One model to place: its traffic, its curve, and what hosting it takes."""

    name: str
    profile: TrafficProfile
    curve: ThroughputCurve
    memory_mib: float
    load_s: float
    pinned: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise FieldError("name", "is required")
        if not math.isfinite(self.memory_mib) or self.memory_mib <= 0:
            raise FieldError("memory_mib", f"must be > 0, got {self.memory_mib}")
        if not math.isfinite(self.load_s) or self.load_s < 0:
            raise FieldError("load_s", f"must be >= 0, got {self.load_s}")


@dataclass(frozen=True, slots=True)
class Layout:
    feasible: bool
    reasons: tuple[str, ...]
    cost: Decimal
    devices_by_hour: tuple[int, ...]
    utilisation: float  # (serving + loading) device time / paid device time
    loading_s: float
    cost_per_million_tokens: Decimal | None

    @property
    def device_hours(self) -> int:
        return sum(self.devices_by_hour)

    @property
    def devices_needed(self) -> int:
        return max(self.devices_by_hour, default=0)


@dataclass(frozen=True, slots=True)
class ModelShare:
    name: str
    dedicated: WhatIfResult
    busy_s: float  # serving device-seconds over the profile, the same in both layouts
    num_loads: int  # swaps into the shared pool's resident set
    loading_s: float  # device-seconds those swaps take, on every running shared device
    shared_cost: Decimal  # rounded to 1e-6; the layout's total is exact
    shared_cost_per_million_tokens: Decimal | None


@dataclass(frozen=True, slots=True)
class ConsolidationHour:
    hour: int
    dedicated_devices: int
    shared_devices: int
    busy_devices: float  # Σ_m B_m(h): serving device-seconds per second
    loading_s: float  # on all running shared devices together
    loaded: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ConsolidationResult:
    dedicated: Layout
    shared: Layout
    models: tuple[ModelShare, ...]
    hours: tuple[ConsolidationHour, ...]
    saving: Decimal | None  # dedicated − shared cost; None unless both are feasible
    saving_pct: float | None
    cheaper: str  # "shared", "dedicated", "equal", or "" when neither is feasible
    caveats: tuple[str, ...]  # what the model leaves out


def check(models: Sequence[ModelLoad], device_memory_mib: float) -> None:
    """Raises FieldError naming the first bad field."""
    if not models:
        raise FieldError("models", "at least one model is needed")
    if not math.isfinite(device_memory_mib) or device_memory_mib <= 0:
        raise FieldError("device_memory_mib", f"must be > 0, got {device_memory_mib}")
    hours = len(models[0].profile.requests_per_s_by_hour)
    names: set[str] = set()
    for i, m in enumerate(models):
        if m.name in names:
            raise FieldError(f"models[{i}].name", f"{m.name!r} is given twice")
        names.add(m.name)
        if len(m.profile.requests_per_s_by_hour) != hours:
            raise FieldError(f"models[{i}].profile", f"{m.name} covers "
                             f"{len(m.profile.requests_per_s_by_hour)} hours, "
                             f"{models[0].name} covers {hours}")
        if m.memory_mib > device_memory_mib:
            raise FieldError(f"models[{i}].memory_mib", f"{m.name} needs {m.memory_mib:g} MiB, "
                             f"more than the device's {device_memory_mib:g} MiB")


def consolidate(models: Sequence[ModelLoad], scenario: Scenario, price_per_hour: Decimal,
                device_memory_mib: float) -> ConsolidationResult:
    """Raises FieldError naming a bad input; a layout that cannot work is infeasible instead."""
    check(models, device_memory_mib)
    alone = [what_if(m.profile, replace(scenario, max_devices=0), m.curve, price_per_hour)
             for m in models]
    busy = [[rps * r.device_s_per_request for rps in m.profile.requests_per_s_by_hour]
            for m, r in zip(models, alone)]
    num_hours, tokens = len(busy[0]), sum(r.tokens for r in alone)
    notes = [f"{m.name}: {reason}" for m, r in zip(models, alone) for reason in r.reasons]
    fits_latency = all(r.feasible for r in alone)  # the one-model what-if's only refusal
    devices = tuple(map(sum, zip(*([h.devices for h in r.hours] for r in alone))))
    dedicated = _layout(devices, [0.0] * num_hours, busy, scenario, price_per_hour, tokens,
                        notes, fits_latency)
    plan, blocked = _plan(models, busy, scenario, device_memory_mib)
    if plan is None:
        shared = _layout((0,) * num_hours, [0.0] * num_hours, busy, scenario, price_per_hour,
                         tokens, notes + blocked, False)
    else:
        contended = plan.swaps.contended_hours
        shared = _layout(plan.devices, plan.load_s, busy, scenario, price_per_hour, tokens,
                         notes + ([_contended(contended)] if contended else []), fits_latency)
    loaded = plan.swaps.loaded_by_hour if plan else ((),) * num_hours
    saving = dedicated.cost - shared.cost if dedicated.feasible and shared.feasible else None
    return ConsolidationResult(
        dedicated, shared, _shares(models, alone, busy, shared, loaded),
        _hours(models, dedicated, shared, busy, loaded, plan), saving,
        float(saving / dedicated.cost * 100) if saving is not None and dedicated.cost else None,
        _cheaper(dedicated, shared, saving), _caveats(scenario))


@dataclass(frozen=True, slots=True)
class _Plan:
    swaps: Swaps
    load_s: list[float]  # ℓ(h): seconds each running shared device spends loading in hour h
    devices: tuple[int, ...]  # shared devices running each hour


def _plan(models: Sequence[ModelLoad], busy: Sequence[Sequence[float]], scenario: Scenario,
          memory_mib: float) -> tuple[_Plan | None, list[str]]:
    """The shared pool's swaps and devices, or None with why it cannot carry the models."""
    pinned_mib = sum(m.memory_mib for m in models if m.pinned)
    capacity = memory_mib - pinned_mib
    if pinned_mib > memory_mib:
        return None, [f"infeasible: the pinned models need {pinned_mib:g} MiB, more than the "
                      f"device's {memory_mib:g} MiB"]
    too_big = [f"infeasible: {m.name} needs {m.memory_mib:g} MiB; beside the pinned models' "
               f"{pinned_mib:g} MiB only {capacity:g} of the device's {memory_mib:g} MiB are "
               f"free" for m in models if not m.pinned and m.memory_mib > capacity]
    if too_big:
        return None, too_big
    demand = [[not m.pinned and rps > 0 for m, rps in zip(models, hour)]
              for hour in zip(*(m.profile.requests_per_s_by_hour for m in models))]
    plan = swaps(demand, [m.memory_mib for m in models], capacity)
    load_s = [sum(models[m].load_s for m in hour) for hour in plan.loaded_by_hour]
    u = scenario.target_utilisation
    needed, blocked = [], []
    for h, (loading, total) in enumerate(zip(load_s, map(sum, zip(*busy)))):
        room = u - loading / 3600
        if total > 0 and room <= 0:
            names = ", ".join(models[m].name for m in plan.loaded_by_hour[h])
            blocked.append(f"infeasible: hour {h} loads {names} for {loading:g} s, all of a "
                           f"device's {3600 * u:g} s at target utilisation {u:g}")
        needed.append(math.ceil(total / room - _FUZZ) if total > 0 and room > 0 else 0)
    if blocked:
        return None, blocked
    devices = needed if scenario.autoscale else [max(needed)] * len(needed)
    return _Plan(plan, load_s, tuple(devices)), []


def _layout(devices: Sequence[int], load_s: Sequence[float], busy: Sequence[Sequence[float]],
            scenario: Scenario, price: Decimal, tokens: float, reasons: list[str],
            feasible: bool) -> Layout:
    over = []
    if scenario.max_devices and max(devices, default=0) > scenario.max_devices:
        over = [f"infeasible: needs {max(devices)} devices at the peak hour; only "
                f"{scenario.max_devices} available"]
    loading = sum((n * s for n, s in zip(devices, load_s)), 0.0)
    paid_s = sum(devices) * 3600
    cost = price * sum(devices)
    utilisation = (sum(map(sum, busy)) * 3600 + loading) / paid_s if paid_s else 0.0
    return Layout(feasible and not over, tuple(reasons + over), cost, tuple(devices),
                  utilisation, loading, per_million(cost, tokens))


def _shares(models: Sequence[ModelLoad], alone: Sequence[WhatIfResult],
            busy: Sequence[Sequence[float]], shared: Layout,
            loaded: Sequence[Sequence[int]]) -> tuple[ModelShare, ...]:
    """Each model's part of both layouts; the shared cost goes pro rata to device time."""
    rows = []
    for i, (m, r, b) in enumerate(zip(models, alone, busy)):
        hours = [h for h, hour in enumerate(loaded) if i in hour]
        loading = sum(shared.devices_by_hour[h] for h in hours) * m.load_s
        rows.append((m, r, sum(b) * 3600, len(hours), loading))
    used = sum(busy_s + loading for _, _, busy_s, _, loading in rows)
    shares = []
    for m, r, busy_s, num_loads, loading in rows:
        cost = (shared.cost * Decimal(busy_s + loading) / Decimal(used)).quantize(MICRO) \
            if used else Decimal(0)
        shares.append(ModelShare(m.name, r, busy_s, num_loads, loading, cost,
                                 per_million(cost, r.tokens)))
    return tuple(shares)


def _hours(models: Sequence[ModelLoad], dedicated: Layout, shared: Layout,
           busy: Sequence[Sequence[float]], loaded: Sequence[Sequence[int]],
           plan: _Plan | None) -> tuple[ConsolidationHour, ...]:
    columns = zip(dedicated.devices_by_hour, shared.devices_by_hour, map(sum, zip(*busy)),
                  plan.load_s if plan else [0.0] * len(loaded), loaded)
    return tuple(ConsolidationHour(h, ded, sha, total, sha * load_s,
                                   tuple(models[m].name for m in hour))
                 for h, (ded, sha, total, load_s, hour) in enumerate(columns))


def _cheaper(dedicated: Layout, shared: Layout, saving: Decimal | None) -> str:
    if saving is not None:
        return "shared" if saving > 0 else "dedicated" if saving < 0 else "equal"
    return "dedicated" if dedicated.feasible else "shared" if shared.feasible else ""


def _contended(hours: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for h in hours:
        if runs and runs[-1][1] == h - 1:
            runs[-1][1] = h
        else:
            runs.append([h, h])
    spans = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return (f"hours {spans}: the models with demand do not fit in memory "
            "together; they take turns, each loaded once, and requests wait for their "
            "model's turn (not in the latency figures)")


def _caveats(scenario: Scenario) -> tuple[str, ...]:
    caveats = ["queueing is not modelled: devices are sized by busy time / target utilisation",
               "latency on a shared device is not modelled: the models' batches interleave, so "
               "each model is slower than its p95 alone (up to its curve at the summed "
               "concurrency)"]
    if scenario.autoscale:
        caveats.append("a device added by autoscaling starts cold; that load is counted in "
                       "neither layout (only the shared pool's swaps are)")
    return tuple(caveats)
