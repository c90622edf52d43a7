"""Live workers, discovered from their Redis leases and probed with GetLoad."""
from __future__ import annotations

import asyncio
import json
import logging
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


@dataclass(eq=False)
class WorkerHandle:
    """The router's view of one worker. Only the dispatcher's event loop mutates it."""

    worker_id: str
    address: str
    max_inflight: int
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerServiceStub
    num_inflight: int = 0
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

    @property
    def free_slots(self) -> int:
        if not self.healthy or (self.breaker is not None and not self.breaker.available()):
            return 0
        return self.max_inflight - self.num_inflight


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

    async def refresh(self) -> None:
        leases: dict[str, dict] = {}
        async for key in self.redis.scan_iter(match=f"{queue.WORKER_KEY_PREFIX}*", count=100):
            raw = await self.redis.get(key)
            if raw:
                info = json.loads(raw)
                leases[info["worker_id"]] = info
        for worker_id in list(self.workers):
            if worker_id not in leases:
                log.warning("worker %s lease expired; removing", worker_id)
                await self.workers.pop(worker_id).channel.close()
        for worker_id, info in leases.items():
            handle = self.workers.get(worker_id)
            if handle is None or handle.address != info["address"]:
                self._add(info)
            elif not handle.healthy:
                handle.healthy = True  # a fresh lease after a failure: try it again
        await self._probe_loads()
        self.changed.set()

    def _add(self, info: dict) -> None:
        # Mutual TLS, and the far end must hold a worker certificate: a lease naming any other
        # address (a forged one in Redis) cannot draw requests.
        channel = mtls.aio_channel(info["address"], self.identity, Role.WORKER)
        self.workers[info["worker_id"]] = WorkerHandle(
            worker_id=info["worker_id"], address=info["address"],
            max_inflight=int(info.get("max_inflight", 32)), channel=channel,
            stub=worker_pb2_grpc.WorkerServiceStub(channel),
            breaker=CircuitBreaker(info["worker_id"], open_s=self.breaker_open_s))
        log.info("worker %s at %s joined", info["worker_id"], info["address"])

    async def _probe_loads(self) -> None:
        async def probe(h: WorkerHandle):
            try:
                h.load = await h.stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=1.0)
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

    def available(self) -> list[WorkerHandle]:
        return [h for h in self.workers.values() if h.free_slots > 0]

    async def close(self) -> None:
        for h in self.workers.values():
            await h.channel.close()
