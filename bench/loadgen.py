"""The load generator: open loop (Poisson arrivals fired on schedule, whatever the target's state)
or closed loop (N requests always in flight), bounded in count and time so it stops by itself.

Open loop is what makes latency under load honest: a closed loop slows its own arrivals when
the server slows down and hides the queueing it causes (coordinated omission). The send lag —
how late each request left against its schedule — is kept to show the client kept up.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.targets import TargetError
from bench.workload import RequestSpec

DRAIN_TIMEOUT = "DRAIN_TIMEOUT"  # still running when the drain window closed: cancelled


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it; times are seconds since the level started."""
    spec: RequestSpec
    sent_s: float = 0.0
    first_token_s: float | None = None
    end_s: float | None = None
    usage: dict = field(default_factory=dict)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.end_s is not None and self.first_token_s is not None

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens", 0))

    @property
    def tpot_s(self) -> float | None:
        """(e2e - TTFT) / (tokens - 1), as vLLM's benchmark_serving defines it: chunking-proof."""
        n = self.completion_tokens
        return (self.end_s - self.first_token_s) / (n - 1) if n > 1 else None


@dataclass(slots=True)
class RunStats:
    outcomes: list[Outcome]
    started_unix_s: float
    wall_s: float  # first send to last completion (or the end of the drain window)
    max_send_lag_s: float
    load_samples: list[dict]


async def _one(target, outcome: Outcome, t0: float) -> None:
    outcome.sent_s = time.perf_counter() - t0
    try:
        async for event in target.stream(outcome.spec):
            now = time.perf_counter() - t0
            if isinstance(event, dict):
                outcome.usage = event
                outcome.end_s = now
            elif event and outcome.first_token_s is None:
                outcome.first_token_s = now
    except TargetError as exc:
        outcome.error = str(exc)
    except asyncio.CancelledError:
        outcome.error = DRAIN_TIMEOUT
        raise
    except Exception as exc:  # noqa: BLE001 - one broken request must not end the run
        outcome.error = type(exc).__name__
    if not outcome.error and outcome.end_s is None:
        outcome.error = "NO_FINAL"


class _Sampler:
    """Polls target.load() while a level runs (KV usage, running, waiting)."""

    def __init__(self, target, interval_s: float) -> None:
        self.target, self.interval_s, self.samples = target, interval_s, []

    async def run(self) -> None:
        while True:
            sample = await self.target.load()
            if sample is not None:
                self.samples.append(sample)
            await asyncio.sleep(self.interval_s)


async def _measured(target, body, sample_interval_s: float) -> tuple[float, float, list[dict]]:
    sampler = _Sampler(target, sample_interval_s)
    task = asyncio.create_task(sampler.run())
    started_unix, t0 = time.time(), time.perf_counter()
    try:
        await body(t0)
    finally:
        task.cancel()
    return started_unix, t0, sampler.samples


async def run_open_loop(target, specs: list[RequestSpec], drain_s: float,
                        on_done: Callable[[], None] = lambda: None,
                        sample_interval_s: float = 0.5) -> RunStats:
    """Fire each request at its arrival time; after the last, wait at most drain_s for the rest."""
    outcomes = [Outcome(spec) for spec in specs]
    lag = [0.0]

    async def body(t0: float) -> None:
        tasks = []
        for outcome in outcomes:
            delay = outcome.spec.at_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            lag[0] = max(lag[0], time.perf_counter() - t0 - outcome.spec.at_s)
            task = asyncio.create_task(_one(target, outcome, t0))
            task.add_done_callback(lambda _: on_done())
            tasks.append(task)
        await _drain(tasks, drain_s)

    started_unix, t0, samples = await _measured(target, body, sample_interval_s)
    return RunStats(outcomes, started_unix, _wall(outcomes, t0), lag[0], samples)


async def run_closed_loop(target, specs: list[RequestSpec], concurrency: int, timeout_s: float,
                          on_done: Callable[[], None] = lambda: None,
                          sample_interval_s: float = 0.5) -> RunStats:
    """Keep `concurrency` requests in flight until every spec ran or timeout_s passed."""
    outcomes = [Outcome(spec) for spec in specs]
    queue = list(reversed(outcomes))

    async def slot(t0: float) -> None:
        while queue:
            await _one(target, queue.pop(), t0)
            on_done()

    async def body(t0: float) -> None:
        await _drain([asyncio.create_task(slot(t0)) for _ in range(concurrency)], timeout_s)
        for outcome in queue:  # never started: the level ran out of time
            outcome.error = DRAIN_TIMEOUT

    started_unix, t0, samples = await _measured(target, body, sample_interval_s)
    return RunStats(outcomes, started_unix, _wall(outcomes, t0), 0.0, samples)


async def _drain(tasks: list[asyncio.Task], timeout_s: float) -> None:
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def _wall(outcomes: list[Outcome], t0: float) -> float:
    ends = [o.end_s for o in outcomes if o.end_s is not None]
    return max(ends) if ends and not any(o.error == DRAIN_TIMEOUT for o in outcomes) \
        else time.perf_counter() - t0
