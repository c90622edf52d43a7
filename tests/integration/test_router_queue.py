"""The dispatcher's reading of the two class queues, driven directly against a real redis-server
with an in-test aio WorkerService (no model): entries of both classes that share a stream id are
both held and both run at once (no takeover), and a request's queue time counts from enqueue."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import redis.asyncio as aioredis
from opentelemetry import trace

from llmmesh import queue
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity, server_credentials
from llmmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from router.dispatcher import Dispatcher, DispatcherConfig
from router.policy import make_policy
from router.registry import WorkerRegistry
from router.relay import RequestProgress, run_attempt

WORKER_QUEUE_S = 0.25


class FinalOnlyWorker(worker_pb2_grpc.WorkerServiceServicer):
    """Answers every Generate with one final message that says it waited WORKER_QUEUE_S."""

    def __init__(self):
        self.request_ids: list[str] = []

    async def Generate(self, request, context):
        self.request_ids.append(request.request_id)
        yield worker_pb2.WorkerGenerateResponse(final=worker_pb2.WorkerFinal(
            token_ids=[7, 8], finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                   completion_tokens=2, queue_seconds=WORKER_QUEUE_S)))

    async def GetLoad(self, request, context):
        return worker_pb2.GetLoadResponse(models=[request.model or "m"], device_type="cpu")

    async def Abort(self, request, context):
        return worker_pb2.AbortResponse(aborted=False)


def _entry(request_id: str, cls: str, enqueued_unix_ns: int = 0) -> queue.QueueEntry:
    return queue.QueueEntry(
        request_id=request_id, tenant_id="acme", request_class=cls, model="m",
        prompt_token_ids=[1, 2, 3], cache_salt="scope:acme", block_hashes=[],
        sampling={"max_tokens": 2, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "stop": [],
                  "logprobs": False, "seed": None},
        enqueued_unix_ns=enqueued_unix_ns)


async def _with_worker(redis_url: str, body, worker: FinalOnlyWorker | None = None):
    worker = worker or FinalOnlyWorker()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(MeshIdentity.from_env(Role.WORKER)))
    await server.start()
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    registry = WorkerRegistry(redis, MeshIdentity.from_env(Role.ROUTER))
    registry._add({"worker_id": "w1", "address": f"127.0.0.1:{port}", "max_inflight": 8,
                   "models": [{"name": "m", "state": "loaded"}]})
    try:
        return await body(redis, registry, worker)
    finally:
        await registry.close()
        await redis.aclose()
        await server.stop(0)


def test_interactive_and_batch_entries_with_the_same_stream_id_both_run_at_once(redis_server):
    async def body(redis, registry, worker):
        dispatcher = Dispatcher(redis, registry, make_policy("least-load"),
                                DispatcherConfig(consumer="r1"), trace.get_tracer("test"))
        await dispatcher.ensure_groups()
        # Both streams' ids are "<ms>-<seq>": two entries added in one millisecond share one.
        for cls in queue.CLASSES:
            await redis.xadd(queue.queue_stream(cls), _entry(f"req-{cls}", cls).encode(), id="5-0")
        run = asyncio.create_task(dispatcher.run())
        try:
            deadline = time.monotonic() + 5
            while len(worker.request_ids) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            # Well inside the takeover's 15 s: the router never loses sight of either entry.
            assert sorted(worker.request_ids) == ["req-batch", "req-interactive"]
            while dispatcher.held and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert not dispatcher.held
            for cls in queue.CLASSES:
                pending = await redis.xpending(queue.queue_stream(cls), queue.ROUTER_GROUP)
                assert pending["pending"] == 0, cls
                events = await redis.xrange(queue.result_stream(f"req-{cls}"))
                assert queue.decode_event(events[-1][1])["kind"] == "final"
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
    asyncio.run(_with_worker(redis_server.url, body))


@pytest.mark.parametrize("waited_s", [0.0, 2.0])
def test_queue_time_counts_from_enqueue_not_from_the_worker(redis_server, waited_s):
    async def body(redis, registry, worker):
        enqueued = time.time_ns() - int(waited_s * 1e9)
        p = RequestProgress(_entry("req-q", "interactive", enqueued_unix_ns=enqueued))
        assert await run_attempt(p, registry.workers["w1"], redis) == "length"
        return p.usage()["queue_s"]
    queue_s = asyncio.run(_with_worker(redis_server.url, body))
    assert waited_s + WORKER_QUEUE_S <= queue_s < waited_s + WORKER_QUEUE_S + 0.5


async def _until(predicate, timeout_s: float = 5.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not (value := await predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return value


def test_an_undecodable_entry_is_dead_lettered_and_the_loop_goes_on(redis_server):
    async def body(redis, registry, worker):
        dispatcher = Dispatcher(redis, registry, make_policy("least-load"),
                                DispatcherConfig(consumer="r1"), trace.get_tracer("test"))
        await dispatcher.ensure_groups()
        stream = queue.queue_stream("interactive")
        bad = await redis.xadd(stream, {"d": '{"request_id": "x", "a_field_from_the_future": 1}'})
        await redis.xadd(stream, _entry("req-good", "interactive").encode())
        run = asyncio.create_task(dispatcher.run())
        try:
            await _until(lambda: asyncio.sleep(0, worker.request_ids == ["req-good"]), what="the good one")
            dead = await _until(lambda: redis.xrange(queue.DEAD_LETTER_STREAM), what="a dead letter")
            assert not run.done()
            assert dead[0][1]["entry_id"] == bad and "undecodable" in dead[0][1]["reason"]
            await _until(lambda: asyncio.sleep(0, not dispatcher.held), what="the good one to end")
            assert (await redis.xpending(stream, queue.ROUTER_GROUP))["pending"] == 0
            assert await redis.xlen(stream) == 0
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
    asyncio.run(_with_worker(redis_server.url, body))


def test_an_entry_delivered_past_the_limit_is_dead_lettered_once_taken_over(redis_server):
    """Routers that read an entry and died: Redis counts each delivery. The entry a fourth
    router takes over ends in UNAVAILABLE (told to its client, kept without its prompt in the
    dead-letter stream); one delivered once before is simply run."""
    async def body(redis, registry, worker):
        config = DispatcherConfig(consumer="live", claim_idle_ms=200, heartbeat_s=0.05)
        dispatcher = Dispatcher(redis, registry, make_policy("least-load"), config,
                                trace.get_tracer("test"))
        await dispatcher.ensure_groups()
        stream = queue.queue_stream("batch")
        poison = await redis.xadd(stream, _entry("req-poison", "batch").encode())
        await redis.xreadgroup(queue.ROUTER_GROUP, "dead-0", {stream: ">"}, count=1)
        for dead in ("dead-1", "dead-2"):        # two more routers took it over and died
            await redis.xclaim(stream, queue.ROUTER_GROUP, dead, 0, [poison])
        await redis.xadd(stream, _entry("req-once", "batch").encode())
        await redis.xreadgroup(queue.ROUTER_GROUP, "dead-3", {stream: ">"}, count=1)
        await asyncio.sleep(0.25)                # both idle past claim_idle_ms
        tasks = [asyncio.create_task(dispatcher.run()), asyncio.create_task(dispatcher.reclaim())]
        try:
            await _until(lambda: asyncio.sleep(0, "req-once" in worker.request_ids), what="req-once")
            events = await _until(lambda: redis.xrange(queue.result_stream("req-poison")),
                                  what="the poisoned request's end")
            end = queue.decode_event(events[-1][1])
            assert end["kind"] == "error" and end["code"] == "UNAVAILABLE", end
            assert "req-poison" not in worker.request_ids
            (record,) = [f for _, f in await redis.xrange(queue.DEAD_LETTER_STREAM)]
            assert record["request_id"] == "req-poison" and record["tenant_id"] == "acme"
            assert "prompt_token_ids" not in record and "[1, 2, 3]" not in str(record)
            assert await _until(lambda: asyncio.sleep(0, not dispatcher.held), what="both to end")
            assert (await redis.xpending(stream, queue.ROUTER_GROUP))["pending"] == 0
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.run(_with_worker(redis_server.url, body))


class SlowWorker(FinalOnlyWorker):
    """One slot, and each Generate holds it for HOLD_S before its final."""

    HOLD_S = 1.5

    async def Generate(self, request, context):
        self.request_ids.append(request.request_id)
        await asyncio.sleep(self.HOLD_S)
        yield worker_pb2.WorkerGenerateResponse(final=worker_pb2.WorkerFinal(
            token_ids=[7], finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                   completion_tokens=1)))


def test_an_entry_waiting_for_a_slot_ends_at_its_deadline_not_when_a_slot_frees(redis_server):
    """F2's router side: behind a slow worker's full slot, entries with a 300 ms deadline get
    DEADLINE_EXCEEDED at their deadline (they waited for the slot before: 1.2 s late here);
    one without a deadline still waits and runs, and none of the expired ones reach the worker."""
    async def body(redis, registry, worker):
        registry.workers["w1"].max_inflight = registry.workers["w1"].max_running = 1
        dispatcher = Dispatcher(redis, registry, make_policy("least-load"),
                                DispatcherConfig(consumer="r1"), trace.get_tracer("test"))
        await dispatcher.ensure_groups()
        stream = queue.queue_stream("interactive")
        await redis.xadd(stream, _entry("req-first", "interactive").encode())
        run = asyncio.create_task(dispatcher.run())
        try:
            await _until(lambda: _ran(worker, "req-first"), what="the first request to run")
            deadline_ns = time.time_ns() + 300_000_000
            for i in range(5):
                e = _entry(f"req-short{i}", "interactive")
                e.deadline_unix_ns = deadline_ns
                await redis.xadd(stream, e.encode())
            await redis.xadd(stream, _entry("req-patient", "interactive").encode())
            lateness_ms = []
            for i in range(5):
                event = await _until(lambda: _last_event(redis, f"req-short{i}"), 3.0,
                                     what=f"req-short{i}'s end")
                lateness_ms.append((time.time_ns() - deadline_ns) / 1e6)
                assert event["kind"] == "error" and event["code"] == "DEADLINE_EXCEEDED"
            assert max(lateness_ms) < 150, lateness_ms
            assert await _until(lambda: _ran(worker, "req-patient"), 5.0, what="req-patient")
            assert worker.request_ids == ["req-first", "req-patient"]
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
    asyncio.run(_with_worker(redis_server.url, body, SlowWorker()))


async def _ran(worker, request_id: str) -> bool:
    return request_id in worker.request_ids


async def _last_event(redis, request_id: str) -> dict | None:
    events = await redis.xrange(queue.result_stream(request_id))
    return queue.decode_event(events[-1][1]) if events else None


class HoldingWorker(FinalOnlyWorker):
    """Each Generate holds its slot until the test releases them all."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()

    async def Generate(self, request, context):
        self.request_ids.append(request.request_id)
        await self.release.wait()
        yield worker_pb2.WorkerGenerateResponse(final=worker_pb2.WorkerFinal(
            token_ids=[7], finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                   completion_tokens=1)))


def test_interactive_takes_seats_batch_holds_past_the_slot_cap_up_to_its_share(redis_server):
    """Batch fills its 80% of a worker's 5 slots (4 engine seats): interactive entries still
    start at once, past the cap, in seats batch holds (the engine preempts batch for them), up
    to 3 of the 4 seats (batch_min_share 0.2 keeps one for batch); the 4th waits for a slot.
    Before, only the one slot batch left free ran interactive work (chaos L2: admitted chat
    turns waited p99 150-180 ms for a slot under a 10 ms wait bound). Batch never goes past."""
    async def body(redis, registry, worker):
        handle = registry.workers["w1"]
        handle.max_inflight, handle.max_running = 5, 4
        dispatcher = Dispatcher(redis, registry, make_policy("least-load"),
                                DispatcherConfig(consumer="r1"), trace.get_tracer("test"))
        await dispatcher.ensure_groups()
        for i in range(5):
            await redis.xadd(queue.queue_stream("batch"), _entry(f"b{i}", "batch").encode())
        run = asyncio.create_task(dispatcher.run())
        try:
            await _until(lambda: _count(worker, "b", 4), what="4 batch requests to run")
            for i in range(4):
                await redis.xadd(queue.queue_stream("interactive"),
                                 _entry(f"i{i}", "interactive").encode())
            await _until(lambda: _count(worker, "i", 3), what="3 interactive requests to run")
            await asyncio.sleep(0.3)
            assert sorted(worker.request_ids) == ["b0", "b1", "b2", "b3", "i0", "i1", "i2"]
            assert handle.num_inflight == 7 and handle.num_interactive == 3
            worker.release.set()
            await _until(lambda: _count(worker, "", 9), what="all to run")
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
    asyncio.run(_with_worker(redis_server.url, body, HoldingWorker()))


async def _count(worker, prefix: str, n: int) -> bool:
    return sum(r.startswith(prefix) for r in worker.request_ids) >= n
