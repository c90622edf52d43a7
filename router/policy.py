"""Worker-selection policies behind one small protocol, so they can be benchmarked side by side."""
from __future__ import annotations

import itertools
import time
from typing import Protocol

from llmmesh.queue import QueueEntry
from router.registry import WorkerHandle


class Policy(Protocol):
    name: str

    def select_worker(self, entry: QueueEntry, workers: list[WorkerHandle]) -> WorkerHandle | None: ...

    def on_dispatched(self, entry: QueueEntry, worker: WorkerHandle) -> None: ...


class RoundRobin:
    name = "round-robin"

    def __init__(self):
        self._counter = itertools.count()

    def select_worker(self, entry, workers):
        if not workers:
            return None
        ordered = sorted(workers, key=lambda h: h.worker_id)
        return ordered[next(self._counter) % len(ordered)]

    def on_dispatched(self, entry, worker):
        pass


class LeastLoad:
    name = "least-load"

    def select_worker(self, entry, workers):
        return min(workers, key=lambda h: (h.num_inflight / h.max_inflight, h.worker_id), default=None)

    def on_dispatched(self, entry, worker):
        pass


def _matched_blocks(entry: QueueEntry, worker: WorkerHandle) -> int:
    n = 0
    for h in entry.block_hashes:
        if h not in worker.cached_hashes and h not in worker.recent_hashes:
            break
        n += 1
    return n


class PrefixAffinity:
    """Longest run of cached prefix blocks wins, unless that worker is much busier than the least loaded."""

    name = "prefix-affinity"

    def __init__(self, max_load_gap: float = 0.25):
        self.max_load_gap = max_load_gap
        self._fallback = LeastLoad()

    def select_worker(self, entry, workers):
        least = self._fallback.select_worker(entry, workers)
        if least is None or not entry.block_hashes:
            return least
        best = max(workers, key=lambda h: (_matched_blocks(entry, h), -h.num_inflight))
        if _matched_blocks(entry, best) == 0:
            return least
        gap = best.num_inflight / best.max_inflight - least.num_inflight / least.max_inflight
        return best if gap <= self.max_load_gap else least

    def on_dispatched(self, entry, worker):
        # Until the worker's next report (the registry clears these each refresh).
        now = time.monotonic()
        worker.recent_hashes.update((h, now) for h in entry.block_hashes)


def place(policy: Policy, entry: QueueEntry, available: list[WorkerHandle],
          fleet: list[WorkerHandle], waited_s: float) -> WorkerHandle | None:
    """Model-aware placement in front of any policy. Only workers that serve the request's
    model are candidates; one where it is loaded wins (a worker whose circuit waits for its
    probe first, else the policy picks among those: load and prefix affinity); else one where
    it is loading (the request waits there); else a cold start, but only once the request has
    waited for a warm slot as long as the cold start would take (never wait longer for a busy
    warm worker than loading it elsewhere costs). A cold start goes where the model fits
    without unloading anything, then where an idle model can make room, the least loaded
    first. None: wait (and ask again)."""
    model = entry.model
    # One read of each worker's model table (built from its last GetLoad or lease).
    served = {h: h.models().get(model) for h in available}
    serving = [h for h, m in served.items() if m is not None]
    warm = [h for h in serving if served[h][0] == "loaded"]
    if warm:
        # One request probes a worker whose circuit has cooled down, whatever the policy would
        # pick: otherwise it may never get one (a failed probe is retried elsewhere).
        probe = next((h for h in warm if h.breaker is not None and h.breaker.wants_probe()), None)
        return probe or policy.select_worker(entry, warm)
    loading = [h for h in serving if served[h][0] == "loading"]
    if loading:
        return min(loading, key=_load_ratio)
    if not serving:
        return None
    busy_warm = [h for h in fleet if h.healthy and h.model_state(model) in ("loaded", "loading")]
    if busy_warm and waited_s < min(served[h][1] for h in serving):
        return None

    def fit(h: WorkerHandle) -> tuple:
        free = h.free_memory_bytes
        room = 0 if free is None or free > 0 else 1
        evictable = any(ev for _, _, ev in h.models().values())
        return room, not evictable, _load_ratio(h)
    return min(serving, key=fit)


def _load_ratio(h: WorkerHandle) -> tuple[float, str]:
    return h.num_inflight / max(1, h.max_inflight), h.worker_id


POLICIES = {p.name: p for p in (RoundRobin, LeastLoad, PrefixAffinity)}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
