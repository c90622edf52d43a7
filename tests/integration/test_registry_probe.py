"""The router's registry against a worker that stops answering (SIGSTOP, a hung host): its lease
is still in Redis, its GetLoad probe hangs. A worker taken out of the way by a failed attempt
comes back only when a probe answers, never for the length of a probe that may not (chaos F6:
a request placed in that window waits on a stopped peer)."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import redis.asyncio as aioredis

from llmmesh import queue
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity
from llmmesh.v1 import worker_pb2, worker_pb2_grpc
from router.registry import WorkerRegistry


class StallingWorker(worker_pb2_grpc.WorkerServiceServicer):
    """GetLoad answers at once while `answering` is set, else hangs until it is."""

    def __init__(self):
        self.answering = asyncio.Event()
        self.answering.set()
        self.num_stalled = 0

    async def GetLoad(self, request, context):
        if not self.answering.is_set():
            self.num_stalled += 1
        await self.answering.wait()
        return worker_pb2.GetLoadResponse(models=["m"], device_type="cpu")


async def _until(predicate, timeout_s: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_a_worker_out_of_the_way_stays_out_while_its_probe_hangs(redis_server, serve_as):
    async def body():
        worker = StallingWorker()
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
        port = serve_as(server, Role.WORKER)
        await server.start()
        redis = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        registry = WorkerRegistry(redis, MeshIdentity.from_env(Role.ROUTER))
        await redis.set(queue.worker_key("w1"), json.dumps(
            {"worker_id": "w1", "address": f"127.0.0.1:{port}", "max_inflight": 4,
             "models": [{"name": "m", "state": "loaded"}]}))
        try:
            await registry.refresh()
            (handle,) = registry.workers.values()
            assert registry.available() == [handle]
            handle.healthy = False               # an attempt on it just failed
            worker.answering.clear()             # and now it stops answering
            refreshing = asyncio.create_task(registry.refresh())
            await _until(lambda: worker.num_stalled == 1, what="the probe to hang")
            assert registry.available() == []    # was [handle] for the probe's 1 s
            await refreshing                     # the probe timed out: still out of the way
            assert registry.available() == []
            worker.answering.set()               # continued: the next probe brings it back
            await registry.refresh()
            assert registry.available() == [handle]
        finally:
            worker.answering.set()
            await registry.close()
            await redis.aclose()
            await server.stop(0)
    asyncio.run(body())
