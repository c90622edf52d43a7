"""The contracts every costd stage keeps: receiver → processors → exporters (the OTel Collector's shape).

A stage is a `Component` (start / shutdown) and a `Consumer` of one batch type. Every consumer
answers with the items it rejected for good; whole-batch failures are raised as a
`PermanentError` (retrying the same data can never succeed) or a `RetryableError` (it may
succeed later, so the sender should keep the data and retry). They are MeshErrors, so the
shared interceptor answers INTERNAL and UNAVAILABLE; OTLP senders retry only the latter.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from llmmesh.errors import Internal, Unavailable

T_contra = TypeVar("T_contra", contravariant=True)


class PipelineError(Exception):
    """A whole batch failed; subclasses say whether the sender should retry it."""


class PermanentError(PipelineError, Internal):
    """Retrying the same batch can never succeed (bad data, a bug, a corrupt store)."""


class RetryableError(PipelineError, Unavailable):
    """The batch may succeed later (store busy, disk full); the sender keeps it and retries."""


@dataclass(frozen=True, slots=True)
class Rejection:
    """One item dropped for good, with the reason an operator needs to fix its sender."""

    item_id: str
    reason: str

    def __str__(self) -> str:
        return f"{self.item_id}: {self.reason}"


class Component(Protocol):
    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...


class Consumer(Protocol[T_contra]):
    async def consume(self, batch: T_contra) -> Sequence[Rejection]: ...


class Pipeline:
    """Starts and stops stages in the order that never strands data in flight.

    Downstream stages start first and stop last, so whatever a receiver accepts always has a
    live exporter to land in (the Collector's start/stop order).
    """

    def __init__(self, stages: Sequence[Component]) -> None:
        # Ordered from receiver to exporter.
        self._stages = tuple(stages)
        self._started: list[Component] = []

    async def start(self) -> None:
        for stage in reversed(self._stages):
            await stage.start()
            self._started.append(stage)

    async def shutdown(self) -> None:
        # Only what started is stopped, so a failed start still releases what it opened.
        while self._started:
            await self._started.pop().shutdown()
