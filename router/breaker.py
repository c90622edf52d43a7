"""A circuit breaker per worker: consecutive failed attempts open it, a cool-down later one probe
goes (half-open), and a success closes it. Lease refreshes do not close it — a worker whose
engine fails every step keeps its lease, and used to be marked healthy at each refresh."""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("router.breaker")


class CircuitState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(slots=True)
class CircuitBreaker:
    name: str
    failure_threshold: int = 3
    open_s: float = 5.0
    clock: object = field(default=time.monotonic, repr=False)
    state: CircuitState = CircuitState.CLOSED
    num_failures: int = 0
    opened_at: float = 0.0
    probing: bool = False

    def __post_init__(self):
        if self.failure_threshold < 1 or self.open_s <= 0:
            raise ValueError("failure_threshold must be >= 1 and open_s > 0")

    def available(self) -> bool:
        """Whether a request may go to this worker now (no side effect)."""
        if self.state is CircuitState.CLOSED:
            return True
        if self.state is CircuitState.OPEN:
            return self.clock() - self.opened_at >= self.open_s
        return not self.probing

    def wants_probe(self) -> bool:
        """Open, and its cool-down is over: the next request sent here is the probe that can
        close it. Placement prefers such a worker, because a policy that never picks it (prefix
        affinity sends a shared system prompt to the worker that cached it) would leave the
        circuit open for good."""
        return self.state is CircuitState.OPEN and self.available()

    def on_dispatch(self) -> bool:
        """Count a request sent to the worker; True if it is the half-open probe."""
        if self.state is CircuitState.OPEN and self.available():
            self._to(CircuitState.HALF_OPEN)
        if self.state is CircuitState.HALF_OPEN:
            self.probing = True
            return True
        return False

    def on_success(self) -> None:
        self.num_failures = 0
        self.probing = False
        if self.state is not CircuitState.CLOSED:
            self._to(CircuitState.CLOSED)

    def on_released(self) -> None:
        """The probe ended with no verdict on the worker (the client cancelled, the request's
        own deadline or arguments): the next request may probe."""
        self.probing = False

    def on_failure(self) -> None:
        self.num_failures += 1
        self.probing = False
        if self.state is CircuitState.HALF_OPEN or self.num_failures >= self.failure_threshold:
            self.opened_at = self.clock()
            if self.state is not CircuitState.OPEN:
                self._to(CircuitState.OPEN)

    def _to(self, state: CircuitState) -> None:
        log.warning("worker %s circuit %s -> %s (%d consecutive failures)", self.name,
                    self.state.value, state.value, self.num_failures)
        self.state = state
