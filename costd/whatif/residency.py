"""Which models a shared device loads each hour: LRU residency under a memory limit.

The rule (one device's view; every device of a shared pool holds the same set):
- pinned models are always resident: their memory is taken off the top, they are never loaded
  during the profile and never evicted;
- any other model stays resident after its last request until memory is needed (keep-alive
  with no timer: an idle resident model costs nothing on a device that is paid for anyway);
  the least recently used goes first;
- within an hour, the models with demand that are resident are served first; then each one
  with demand that is not is loaded, in the order the models were given, evicting until it
  fits — once per hour: when an hour's models do not fit together they take turns (the hour is
  "contended"), and a model's requests wait for its turn;
- the profile repeats (a day after a day): hour 0 starts with what the previous repetition left
  resident, so the answer is the steady state, found by replaying the profile until the set at
  hour 0 repeats. A model that fits beside the others is therefore never loaded at all.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Swaps:
    loaded_by_hour: tuple[tuple[int, ...], ...]  # model indexes loaded in each hour
    contended_hours: tuple[int, ...]  # hours whose models with demand did not fit together


def swaps(demand_by_hour: Sequence[Sequence[bool]], memory_mib: Sequence[float],
          capacity_mib: float) -> Swaps:
    """`demand_by_hour[h][m]`: model m has requests in hour h (pinned models: always False).
    Every model must fit alone: memory_mib[m] <= capacity_mib (the caller checks)."""
    resident: dict[int, int] = {}  # model index → when last used
    clock = itertools.count()
    starts: list[tuple[int, ...]] = []
    loaded: list[tuple[int, ...]] = []
    for _ in range(len(memory_mib) + 2):  # a finite deterministic replay: periodic soon
        start = tuple(sorted(resident, key=resident.__getitem__))
        if start in starts:
            break
        starts.append(start)
        loaded = [_hour(wants, memory_mib, capacity_mib, resident, clock)
                  for wants in demand_by_hour]
    contended = tuple(h for h, wants in enumerate(demand_by_hour)
                      if sum(m for m, w in zip(memory_mib, wants) if w) > capacity_mib)
    return Swaps(tuple(loaded), contended)


def _hour(wants: Sequence[bool], memory_mib: Sequence[float], capacity_mib: float,
          resident: dict[int, int], clock: itertools.count) -> tuple[int, ...]:
    demanded = [m for m, w in enumerate(wants) if w]
    for m in sorted((m for m in demanded if m in resident), key=resident.__getitem__):
        resident[m] = next(clock)
    missing = [m for m in demanded if m not in resident]  # before evictions change it
    for m in missing:
        while sum(memory_mib[r] for r in resident) + memory_mib[m] > capacity_mib:
            del resident[min(resident, key=resident.__getitem__)]
        resident[m] = next(clock)
    return tuple(missing)
