"""A worker's health as the router sees it, against in-test WorkerServices (no model).

A worker that stops answering (SIGSTOP, a hung host) keeps its lease in Redis while its GetLoad
probe hangs: one taken out of the way by a failed attempt comes back only when a probe answers,
never for the length of a probe that may not (chaos F6: a request placed in that window waits on
a stopped peer). A half-open circuit's probe request that ends in a typed error gives its probe
slot back (it kept it, and the circuit stayed half-open for good)."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import redis.asyncio as aioredis

from llmmesh import queue
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity
from opentelemetry import trace

from llmmesh.v1 import worker_pb2, worker_pb2_grpc
from router.breaker import CircuitState
from router.dispatcher import Dispatcher, DispatcherConfig
from router.policy import make_policy
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

    async def Generate(self, request, context):
        # A request the worker refuses (not the worker's fault: no verdict on its health).
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_k: out of range")
        yield  # pragma: no cover - makes this a stream handler

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse(aborted=False)


async def _until(predicate, timeout_s: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def _start(redis_server, serve_as):
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
    return worker, server, redis, registry


def test_a_worker_out_of_the_way_stays_out_while_its_probe_hangs(redis_server, serve_as):
    async def body():
        worker, server, redis, registry = await _start(redis_server, serve_as)
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


def test_a_half_open_probe_that_ends_in_a_typed_error_lets_the_next_request_probe(
        redis_server, serve_as):
    async def body():
        worker, server, redis, registry = await _start(redis_server, serve_as)
        dispatcher = Dispatcher(redis, registry, make_policy("least-load"),
                                DispatcherConfig(consumer="r1"), trace.get_tracer("test"))
        await dispatcher.ensure_groups()
        run = asyncio.create_task(dispatcher.run())
        try:
            await registry.refresh()
            (handle,) = registry.workers.values()
            for _ in range(3):                   # three failed attempts: open
                handle.breaker.on_failure()
            handle.breaker.opened_at -= handle.breaker.open_s   # and cooled down
            entry = queue.QueueEntry(
                request_id="acme/probe/1", tenant_id="acme", request_class="interactive",
                model="m", prompt_token_ids=[1, 2, 3], cache_salt="acme", block_hashes=[],
                sampling={"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                          "stop": [], "logprobs": False, "seed": None})
            await redis.xadd(queue.queue_stream("interactive"), entry.encode())
            stream = queue.result_stream("acme/probe/1")
            deadline = time.monotonic() + 5
            while not await redis.xlen(stream):
                assert time.monotonic() < deadline, "the probe request never ended"
                await asyncio.sleep(0.02)
            end = queue.decode_event((await redis.xrange(stream))[-1][1])
            assert end["kind"] == "error" and end["code"] == "INVALID_ARGUMENT", end
            await _until(lambda: not dispatcher.running, what="the request to be done")
            # No verdict on the worker: still half-open, and the next request may probe it.
            assert handle.breaker.state is CircuitState.HALF_OPEN
            assert handle.breaker.available() and registry.available() == [handle]
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            await registry.close()
            await redis.aclose()
            await server.stop(0)
    asyncio.run(body())


def test_a_malformed_lease_or_one_naming_another_worker_is_skipped_not_fatal(redis_server, serve_as):
    """Workers share one Redis user, so one could write garbage into a lease or a lease naming
    another worker (to take its traffic): the registry skips both and keeps the real worker."""
    async def run():
        worker, server, redis, registry = await _start(redis_server, serve_as)
        try:
            await redis.set(queue.worker_key("w2"), "{not json")
            await redis.set(queue.worker_key("w3"), json.dumps(
                {"worker_id": "w1", "address": "127.0.0.1:1", "max_inflight": 4, "models": []}))
            await redis.set(queue.worker_key("w4"), json.dumps(["a", "list"]))
            await registry.refresh()
            return {w: h.address for w, h in registry.workers.items()}
        finally:
            await server.stop(0)
            await redis.aclose()
    workers = asyncio.run(run())
    assert list(workers) == ["w1"] and workers["w1"] != "127.0.0.1:1"


def test_a_worker_restarted_at_the_same_address_gets_a_fresh_handle(redis_server, serve_as):
    """A lease refresh from the same process keeps the handle (its open circuit included); a new
    incarnation at the same address (a restart behind a fixed --advertise name) replaces it:
    closed circuit, no cache index of the KV cache that is gone, a new channel."""
    async def body():
        worker, server, redis, registry = await _start(redis_server, serve_as)
        lease = json.loads(await redis.get(queue.worker_key("w1")))
        try:
            await redis.set(queue.worker_key("w1"), json.dumps({**lease, "incarnation": "a"}))
            await registry.refresh()
            (old,) = registry.workers.values()
            for _ in range(3):
                old.breaker.on_failure()
            old.recent_hashes[42] = time.monotonic()
            await registry.refresh()                       # the same process renews
            assert registry.workers["w1"] is old
            assert old.breaker.state is CircuitState.OPEN and registry.available() == []
            await redis.set(queue.worker_key("w1"), json.dumps({**lease, "incarnation": "b"}))
            await registry.refresh()                       # restarted, same address
            new = registry.workers["w1"]
            assert new is not old and new.address == old.address and new.incarnation == "b"
            assert new.breaker.state is CircuitState.CLOSED and not new.recent_hashes
            assert registry.available() == [new]
            assert new.channel is not old.channel
        finally:
            await registry.close()
            await redis.aclose()
            await server.stop(0)
    asyncio.run(body())
