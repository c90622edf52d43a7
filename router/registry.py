"""Live workers, discovered from their Redis leases and probed with GetLoad."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field

import grpc
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from llmmesh import mtls, queue
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity
from llmmesh.v1 import worker_pb2, worker_pb2_grpc
from router.breaker import CircuitBreaker

log = logging.getLogger("router.registry")
# Reports lag dispatch by up to two refresh periods (the worker's and ours).
RECENT_HASH_TTL_S = 3.0
# A worker that stops answering (SIGSTOP, a hung host) keeps its TCP connection open: without
# pings its calls would wait for their deadlines. A ping every 2 s while calls run, unanswered
# for 2 s, closes the connection: its calls end UNAVAILABLE and are retried elsewhere, their
# failures open its circuit. (Workers allow pings this often: llmmesh.server.INTERNAL_OPTIONS.)
# grpcio 1.85 enforces the unanswered ping by ping_timeout_ms, not keepalive_timeout_ms: with
# the latter alone a call on a SIGSTOPped peer waited out its 30 s deadline; with both, it
# ended UNAVAILABLE 4.0 s after the stop.
# A replaced handle's channel (the worker restarted or moved) closes after this long: calls
# still on it were to the process that is gone, and end, retried elsewhere, by then.
RETIRED_CHANNEL_GRACE_S = 10.0
WORKER_KEEPALIVE = (("grpc.keepalive_time_ms", 2_000), ("grpc.keepalive_timeout_ms", 2_000),
                    ("grpc.http2.ping_timeout_ms", 2_000), ("grpc.http2.max_pings_without_data", 0))


@dataclass(eq=False)
class WorkerHandle:
    """The router's view of one worker. Only the dispatcher's event loop mutates it."""

    worker_id: str
    address: str
    max_inflight: int
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerServiceStub
    num_inflight: int = 0
    num_interactive: int = 0    # of num_inflight, the interactive requests
    load: worker_pb2.GetLoadResponse | None = None
    # Block hashes the worker reports as cached (the shared index in Redis).
    cached_hashes: frozenset[int] = frozenset()
    # Block hashes this router sent the worker lately (hash -> monotonic time): cached by now,
    # most likely, but not yet in the worker's report.
    recent_hashes: dict[int, float] = field(default_factory=dict)
    # False while its GetLoad probe fails (a lease refresh tries it again).
    healthy: bool = True
    # Opened by failed attempts, closed by a successful one: not by a lease refresh.
    breaker: CircuitBreaker | None = None
    # The lease's model list ({name, state, quantization, load_s, evictable}), until the
    # first GetLoad probe answers with fresher states.
    lease_models: tuple[dict, ...] = ()
    # Requests the worker runs at once (its engine's seats); max_inflight beyond it waits there.
    max_running: int = 0
    # The worker process's id in its lease: a new one at the same address is a restart.
    incarnation: str | None = None

    def models(self) -> dict[str, tuple[str, float, bool]]:
        """Servable model -> (state, cold-start seconds, evictable), freshest source first."""
        if self.load is not None and self.load.model_states:
            return {s.name: (s.state, s.load_seconds, s.evictable) for s in self.load.model_states}
        if self.load is not None and not self.lease_models:   # a worker without model states
            return {m: ("loaded", 0.0, False) for m in self.load.models}
        return {m["name"]: (m.get("state", "loaded"), float(m.get("load_s", 0.0)),
                            bool(m.get("evictable", False))) for m in self.lease_models}

    def model_state(self, model: str) -> str | None:
        """"loaded", "loading", "unloaded" (servable, not loaded) or None (not served here)."""
        entry = self.models().get(model)
        return entry[0] if entry else None

    @property
    def free_memory_bytes(self) -> int | None:
        """Room left in the worker's memory budget (None: no budget, or not probed yet)."""
        if self.load is None or not self.load.memory_budget_bytes:
            return None
        return self.load.memory_budget_bytes - self.load.memory_used_bytes

    @property
    def serving(self) -> bool:
        """Healthy, and its circuit lets requests through."""
        return self.healthy and (self.breaker is None or self.breaker.available())

    @property
    def free_slots(self) -> int:
        if not self.serving:
            return 0
        return self.max_inflight - self.num_inflight

    def interactive_seats(self, batch_seat_share: float) -> int:
        """Seats an interactive request may take from batch work: the engine preempts a running
        batch request for it, so it need not wait for a router slot while batch holds them.
        `batch_seat_share` of the seats stays batch's, so a flood of chat never stops batch."""
        seats = self.max_running or self.max_inflight
        return seats - math.ceil(batch_seat_share * seats)

    def interactive_room(self, batch_seat_share: float) -> int:
        """Interactive requests this router can start here now: a free slot, or a seat batch
        holds (past the slot cap)."""
        if not self.serving:
            return 0
        return max(self.free_slots,
                   self.interactive_seats(batch_seat_share) - self.num_interactive)


def _lease_models(info: dict) -> list[dict]:
    models = info.get("models")
    if isinstance(models, list):
        return [m for m in models if isinstance(m, dict) and isinstance(m.get("name"), str)]
    return [{"name": info["model"], "state": "loaded"}] if info.get("model") else []


class WorkerRegistry:
    """Keeps `workers` in step with the leases workers keep alive in Redis."""

    def __init__(self, redis: aioredis.Redis, identity: MeshIdentity, refresh_s: float = 1.0,
                 breaker_open_s: float = 5.0):
        self.redis = redis
        self.identity = identity
        self.breaker_open_s = breaker_open_s
        self.refresh_s = refresh_s
        self.workers: dict[str, WorkerHandle] = {}
        self.changed = asyncio.Event()
        # Channels of replaced handles, closing after their grace (close() ends them at once).
        self._retiring: dict[asyncio.Task, grpc.aio.Channel] = {}

    async def refresh(self) -> None:
        leases: dict[str, dict] = {}
        async for key in self.redis.scan_iter(match=f"{queue.WORKER_KEY_PREFIX}*", count=100):
            raw = await self.redis.get(key)
            if not raw:
                continue
            try:
                info = json.loads(raw)
                ok = (isinstance(info, dict) and isinstance(info.get("address"), str)
                      and info.get("worker_id") == key[len(queue.WORKER_KEY_PREFIX):])
            except ValueError:
                ok = False
            if not ok:
                # Malformed, or naming another worker than its key does (all workers share one
                # Redis user, so one could try to take another's traffic): skipped, not fatal.
                log.warning("lease %s skipped: malformed or not its own worker's", key)
                continue
            leases[info["worker_id"]] = info
        for worker_id in list(self.workers):
            if worker_id not in leases:
                log.warning("worker %s lease expired; removing", worker_id)
                await self.workers.pop(worker_id).channel.close()
        for worker_id, info in leases.items():
            handle = self.workers.get(worker_id)
            if handle is None:
                self._add(info)
            elif (handle.address != info["address"]
                  or handle.incarnation != info.get("incarnation")):
                # Moved, or restarted at the same address (a fixed --advertise name): a fresh
                # handle, or the new process would inherit the old one's open circuit, its
                # channel's reconnect backoff (up to minutes after a long outage) and the cache
                # index of a KV cache that is gone. The old channel closes once the calls on it
                # (to a process that is gone) have had their grace.
                log.warning("worker %s moved or restarted (%s, incarnation %s -> %s); fresh handle",
                            worker_id, info["address"], handle.incarnation,
                            info.get("incarnation"))
                self._retire(handle)
                self._add(info)
            self.workers[worker_id].lease_models = tuple(_lease_models(info))
        await self._probe_loads()
        self.changed.set()

    def _add(self, info: dict) -> None:
        # Mutual TLS, and the far end must hold a worker certificate: a lease naming any other
        # address (a forged one in Redis) cannot draw requests.
        channel = mtls.aio_channel(info["address"], self.identity, Role.WORKER, WORKER_KEEPALIVE)
        self.workers[info["worker_id"]] = WorkerHandle(
            worker_id=info["worker_id"], address=info["address"],
            max_inflight=int(info.get("max_inflight", 32)), channel=channel,
            stub=worker_pb2_grpc.WorkerServiceStub(channel),
            breaker=CircuitBreaker(info["worker_id"], open_s=self.breaker_open_s),
            lease_models=tuple(_lease_models(info)),
            max_running=int(info.get("max_running") or info.get("max_inflight", 32)),
            incarnation=info.get("incarnation"))
        log.info("worker %s at %s joined", info["worker_id"], info["address"])

    def _retire(self, handle: WorkerHandle) -> None:
        task = asyncio.create_task(handle.channel.close(RETIRED_CHANNEL_GRACE_S))
        self._retiring[task] = handle.channel
        task.add_done_callback(lambda t: self._retiring.pop(t, None))

    async def _probe_loads(self) -> None:
        async def probe(h: WorkerHandle):
            try:
                h.load = await h.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=1.0)
                # An answer brings back a worker a failed attempt took out of the way; a lease
                # alone did, for the length of this probe: a stopped worker's lease outlives it
                # by up to 10 s, and requests placed meanwhile waited on it.
                h.healthy = True
            except grpc.aio.AioRpcError:
                h.healthy = False
            members = await self.redis.smembers(queue.worker_cache_key(h.worker_id))
            h.cached_hashes = frozenset(int(m) for m in members)
            horizon = time.monotonic() - RECENT_HASH_TTL_S
            h.recent_hashes = {k: t for k, t in h.recent_hashes.items() if t > horizon}
        await asyncio.gather(*(probe(h) for h in self.workers.values()))

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except RedisError as exc:
                log.warning("registry refresh failed: %s", exc)
            await asyncio.sleep(self.refresh_s)

    def available(self, batch_seat_share: float | None = None) -> list[WorkerHandle]:
        """With a free slot; for an interactive request (given the share of seats kept for
        batch), also where it can take a seat from batch."""
        if batch_seat_share is None:
            return [h for h in self.workers.values() if h.free_slots > 0]
        return [h for h in self.workers.values() if h.interactive_room(batch_seat_share) > 0]

    def serving(self) -> list[WorkerHandle]:
        """Healthy with a closed circuit, with a free slot or not."""
        return [h for h in self.workers.values() if h.serving]

    async def close(self) -> None:
        for h in self.workers.values():
            await h.channel.close()
        for task, channel in list(self._retiring.items()):
            task.cancel()
            await channel.close()
