"""How fast each class's queue drains, published by routers and read by gateways, so the
gateway can refuse interactive work whose expected wait would break its SLO.

A bound on a class's entries (--max-queue-len) holds memory but not latency: under overload an
admitted chat turn waited for a full queue to drain (chaos L2: admitted interactive TTFT p99
14-18x the unloaded one). Only the routers know what runs and how fast requests end; each
publishes, at every dispatch and end (and every HEARTBEAT_S), its requests on workers per class, the rate at which they end
(over the last WINDOW_S) and, per serving worker, a `WorkerSeats`, in one hash field of
`llmmesh:drain` and on the channel of that name. A gateway follows the channel (a report every
100 ms was too stale: an overload admitted on a view of a free slot that batch had taken since,
and chaos L2 still saw 250-330 ms interactive queue waits), sums the fresh reports and admits
an interactive request only while

    entries in its class's stream  <  dispatched + free + ended/s x max wait

where `free` is what a new interactive request can start in at once: a router slot (a router
sends a worker at most max_inflight) and an engine seat not held by interactive work (an
engine preempts batch work for interactive, so batch holds no seat against it). `free` goes
negative when interactive requests wait inside engines, out of Redis's sight: the first
version counted every router slot as free and chaos L2 measured a 270 ms interactive queue-wait
p99 under a 50 ms bound, from the 4 requests per engine that max_inflight queues there.
An interactive request also goes past the slot cap to a seat batch holds, while interactive
work holds fewer than `interactive_seats` there (the router's ClassPolicy keeps batch_min_share
of the seats for batch): with batch filling its 80% of the slots, interactive had only the
other 20%, and chaos L2's admitted queue waits were p99 150-190 ms under a 10 ms bound (85-123 ms after).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from llmmesh import queue
from llmmesh.vocab import CLASSES, RequestClass

DRAIN_KEY = f"{queue.PREFIX}:drain"      # a hash, and the channel its updates go out on
# A router reports at each change, and at least this often (its report stays fresh).
HEARTBEAT_S = 0.5
# A gateway reads the whole hash this often besides (a router that stopped drops out).
FULL_READ_S = 1.0
WINDOW_S = 2.0
# A router's report unchanged this long is left out (it stopped, or it cannot reach Redis).
# Judged by when the gateway received it, never by the router's clock.
FRESH_S = 2.0
# A router publishes at most this often (changes meanwhile go out together).
MIN_PUBLISH_S = 0.005

log = logging.getLogger("llmmesh.drain")


class DrainMeter:
    """The router's side: ends per class over the last WINDOW_S, published with what runs."""

    def __init__(self, consumer: str) -> None:
        self.consumer = consumer
        self._ends: dict[str, deque[float]] = {c: deque() for c in CLASSES}
        self.changed = asyncio.Event()    # set at each dispatch and end: report now
        self._seq = 0    # in every report: a live router's repeats differ, a stopped one's do not

    def ended(self, request_class: str) -> None:
        now = time.monotonic()
        ends = self._ends[request_class]
        ends.append(now)
        while ends[0] < now - WINDOW_S:
            ends.popleft()
        self.changed.set()

    def rates(self) -> dict[str, float]:
        cut = time.monotonic() - WINDOW_S
        for ends in self._ends.values():
            while ends and ends[0] < cut:
                ends.popleft()
        return {c: len(ends) / WINDOW_S for c, ends in self._ends.items()}

    def report(self, running: dict[str, int], workers: dict[str, WorkerSeats]) -> str:
        """`running`: this router's requests on workers per class; `workers`: per serving
        worker, its seats and this router's requests on it."""
        rates = self.rates()
        self._seq += 1
        return json.dumps({"seq": self._seq, "workers": {w: list(s) for w, s in workers.items()},
                           "classes": {c: {"running": running.get(c, 0), "ended_per_s": rates[c]}
                                       for c in CLASSES}}, separators=(",", ":"))

    async def publish(self, redis: aioredis.Redis, running: dict[str, int],
                      workers: dict[str, WorkerSeats]) -> None:
        report = self.report(running, workers)
        async with redis.pipeline(transaction=False) as pipe:
            pipe.hset(DRAIN_KEY, self.consumer, report)
            pipe.pexpire(DRAIN_KEY, int(FRESH_S * 1000 * 5))
            pipe.publish(DRAIN_KEY, f"{self.consumer} {report}")
            await pipe.execute()


class WorkerSeats(NamedTuple):
    """One serving worker as one router sees it."""

    seats: int                  # requests its engine runs at once
    max_inflight: int           # requests one router may have on it
    num_inflight: int           # this router's requests on it
    num_interactive: int        # ... of which interactive
    # Seats interactive work may take from batch on it (its engine preempts batch), past the
    # slot cap; 0 from a router that predates this (its reports still parse).
    interactive_seats: int = 0


@dataclass(frozen=True, slots=True)
class ClassDrain:
    """One class as all fresh routers see it together."""

    running: int          # dispatched to workers (in a seat, or waiting inside the engine)
    ended_per_s: float
    free_slots: int       # where a new request of the class starts at once (negative: queued)

    def bound(self, max_wait_s: float) -> int:
        """Entries the class's stream may hold for a new one to start within max_wait_s."""
        return self.running + self.free_slots + math.floor(self.ended_per_s * max_wait_s)


def parse(report: str) -> tuple[dict, dict[str, WorkerSeats]]:
    """One router's report: ({class: (running, ended/s)}, {worker: seats}). Raises ValueError."""
    try:
        body = json.loads(report)
        classes = {c: (int(body["classes"][c]["running"]), float(body["classes"][c]["ended_per_s"]))
                   for c in CLASSES}
        workers = {str(w): WorkerSeats(*map(int, s)) for w, s in body["workers"].items()}
    except (KeyError, TypeError, AttributeError, OverflowError) as exc:
        raise ValueError(f"malformed drain report ({type(exc).__name__}: {exc})") from exc
    return classes, workers


def summarise(reports: list[tuple[dict, dict[str, WorkerSeats]]]) -> dict[str, ClassDrain]:
    """Sums routers' parsed reports; {} when there are none."""
    if not reports:
        return {}
    running = {c: 0 for c in CLASSES}
    rates = {c: 0.0 for c in CLASSES}
    slots = 0                       # what the routers may still send, all workers
    seats: dict[str, int] = {}      # worker -> its seats (every router reports the same)
    iseats: dict[str, int] = {}     # worker -> seats interactive may take from batch there
    busy: dict[str, list[int]] = {}  # worker -> [requests, interactive ones], all routers
    for classes, workers in reports:
        for c, (n, rate) in classes.items():
            running[c] += n
            rates[c] += rate
        for w, s in workers.items():
            slots += max(0, s.max_inflight - s.num_inflight)
            seats[w] = max(seats.get(w, 0), s.seats)
            iseats[w] = max(iseats.get(w, 0), s.interactive_seats)
            b = busy.setdefault(w, [0, 0])
            b[0] += s.num_inflight
            b[1] += s.num_interactive
    # Interactive starts at once in a free slot on a seat interactive work does not hold, or
    # past the slot cap in a seat batch holds, while interactive holds fewer than its share.
    # (Negative, without such seats: interactive work waits inside engines.)
    borrow = sum(max(0, iseats[w] - busy[w][1]) for w in seats)
    in_slots = min(slots, sum(seats[w] - busy[w][1] for w in seats))
    free = {RequestClass.INTERACTIVE: max(in_slots, borrow) if borrow else in_slots,
            RequestClass.BATCH: min(slots, sum(seats[w] - busy[w][0] for w in seats))}
    return {c: ClassDrain(running[c], rates[c], free[c]) for c in CLASSES}


class DrainView:
    """The gateway's side: the routers' reports, as they come on the channel."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.classes: dict[str, ClassDrain] = {}
        # router -> (when this gateway got the report, its text, parsed)
        self._reports: dict[str, tuple[float, str, tuple]] = {}

    def current(self, request_class: str) -> ClassDrain | None:
        """The class's drain from the fresh reports, else None (no wait bound without them)."""
        cut = time.monotonic() - FRESH_S
        if any(at < cut for at, _, _ in self._reports.values()):
            self._reports = {r: v for r, v in self._reports.items() if v[0] >= cut}
            self._update()
        return self.classes.get(request_class)

    def take(self, router: str, report: str, now: float | None = None) -> None:
        """A report as received (a repeated one keeps the time it first came: a stopped
        router's last report, still in the hash, ages out)."""
        now = time.monotonic() if now is None else now
        known = self._reports.get(router)
        if known is not None and known[1] == report:
            return
        try:
            parsed = parse(report)
        except ValueError as exc:
            log.warning("drain report of %s left out: %s", router, exc)
            return
        self._reports[router] = (now, report, parsed)
        self._update()

    def _update(self) -> None:
        self.classes = summarise([v[2] for v in self._reports.values()])

    async def refresh(self) -> None:
        for router, report in (await self.redis.hgetall(DRAIN_KEY)).items():
            self.take(router, report)

    async def run(self) -> None:
        """Loop (supervised): follows the channel; reads the hash every FULL_READ_S too."""
        while True:
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(DRAIN_KEY)
                await self.refresh()
                full_read = time.monotonic() + FULL_READ_S
                while True:
                    msg = await pubsub.get_message(ignore_subscribe_messages=True,
                                                   timeout=HEARTBEAT_S)
                    if msg is not None and msg.get("type") == "message":
                        router, _, report = msg["data"].partition(" ")
                        self.take(router, report)
                    if time.monotonic() >= full_read:
                        await self.refresh()
                        full_read = time.monotonic() + FULL_READ_S
            except RedisError:
                pass    # stale soon: admission then goes on the entry bound alone
            finally:
                with contextlib.suppress(RedisError):
                    await pubsub.aclose()
            await asyncio.sleep(0.5)
