"""Which queued request runs next: interactive before batch with a starvation guard, and inside
a class deficit round robin over tenants, weighted by tokens rather than requests.

Transport-free and deterministic, so its properties are unit-tested exactly.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from llmmesh.vocab import RequestClass

T = TypeVar("T")


class DeficitRoundRobin(Generic[T]):
    """DRR (Shreedhar & Varghese) over tenants; an item's cost is its token estimate."""

    def __init__(self, quantum: int = 512):
        if quantum <= 0:
            raise ValueError("quantum must be positive")
        self.quantum = quantum
        self._queues: OrderedDict[str, deque[tuple[T, int]]] = OrderedDict()
        self._deficit: dict[str, int] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, tenant: str, item: T, cost: int) -> None:
        if tenant not in self._queues:
            self._queues[tenant] = deque()
            self._deficit[tenant] = 0
        self._queues[tenant].append((item, max(1, cost)))
        self._len += 1

    def pop(self) -> T | None:
        """The next item; each visit grants a tenant one quantum of tokens."""
        while self._queues:
            tenant, q = next(iter(self._queues.items()))
            item, cost = q[0]
            if self._deficit[tenant] >= cost:
                q.popleft()
                self._len -= 1
                self._deficit[tenant] -= cost
                if not q:  # an idle tenant keeps no credit (DRR's rule)
                    del self._queues[tenant]
                    del self._deficit[tenant]
                return item
            self._deficit[tenant] += self.quantum
            self._queues.move_to_end(tenant)
        return None

    def remove(self, tenant: str, item: T) -> bool:
        """Take `item` out wherever it waits (it expired there); False if it is not here."""
        q = self._queues.get(tenant)
        for i, (queued, _) in enumerate(q or ()):
            if queued is item:
                del q[i]
                self._len -= 1
                if not q:   # as pop: an idle tenant keeps no credit
                    del self._queues[tenant]
                    del self._deficit[tenant]
                return True
        return False

    def tenants(self) -> list[str]:
        return list(self._queues)


@dataclass(frozen=True, slots=True)
class ClassPolicy:
    # Batch gets at least this share of dispatches whenever it has work waiting, and keeps this
    # share of each worker's seats: interactive requests go past a worker's slot cap to take
    # seats from batch (its engine preempts batch for them) only up to the rest.
    batch_min_share: float = 0.2
    # Batch may fill at most this share of the fleet's router-side slots, so an interactive
    # arrival always finds room. Workers advertise their running-batch size plus a quarter as
    # slots, so 0.8 still keeps every worker's running batch full of batch work, while the
    # rest of the queue stays in the router, where tenants are shared fairly.
    batch_max_slot_share: float = 0.8
    window: int = 100

    def __post_init__(self):
        if not (0 <= self.batch_min_share <= 1 and 0 < self.batch_max_slot_share <= 1):
            raise ValueError("shares must be in [0, 1]")


class ClassScheduler(Generic[T]):
    def __init__(self, policy: ClassPolicy = ClassPolicy(), quantum: int = 512):
        self.policy = policy
        # One tenant-fair queue per class, in priority order (llmmesh.vocab.RequestClass).
        self.queues = {c: DeficitRoundRobin[T](quantum) for c in RequestClass}
        self._recent: deque[str] = deque(maxlen=policy.window)

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def push(self, request_class: str, tenant: str, item: T, cost: int) -> None:
        self.queues[request_class].push(tenant, item, cost)

    def remove(self, request_class: str, tenant: str, item: T) -> bool:
        return self.queues[request_class].remove(tenant, item)

    def _batch_starved(self) -> bool:
        if not self._recent:
            return False
        return self._recent.count(RequestClass.BATCH) / len(self._recent) < self.policy.batch_min_share

    def _batch_room(self, total_slots: int, batch_inflight: int) -> bool:
        return batch_inflight < self.policy.batch_max_slot_share * total_slots

    def ready(self, free_slots: int, total_slots: int, batch_inflight: int,
              interactive_free: int | None = None) -> bool:
        """Whether pop would hand out something now."""
        return self._order(free_slots, total_slots, batch_inflight, interactive_free) != []

    def pop(self, free_slots: int, total_slots: int, batch_inflight: int,
            interactive_free: int | None = None) -> tuple[str, T] | None:
        """Next (class, item) to dispatch given the fleet's slots, or None. `interactive_free`:
        where an interactive request can start (free slots plus seats it may take from batch;
        default free_slots)."""
        for cls in self._order(free_slots, total_slots, batch_inflight, interactive_free):
            item = self.queues[cls].pop()
            if item is not None:
                self._recent.append(cls)
                return cls, item
        return None

    def _order(self, free_slots: int, total_slots: int, batch_inflight: int,
               interactive_free: int | None) -> list[str]:
        """The classes with work that may go now, in the order they go."""
        room = {RequestClass.INTERACTIVE:
                free_slots if interactive_free is None else interactive_free,
                RequestClass.BATCH:
                free_slots if self._batch_room(total_slots, batch_inflight) else 0}
        order = [c for c in self.queues if len(self.queues[c]) and room[c] > 0]
        if RequestClass.BATCH in order and self._batch_starved():
            order.remove(RequestClass.BATCH)
            order.insert(0, RequestClass.BATCH)   # its guaranteed share comes first
        return order
