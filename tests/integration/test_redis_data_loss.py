"""Redis restarting without its data, piece by piece against a real redis-server killed and
started again empty: the epoch tells a wipe from nothing; a router's end (final or error, and
its bill) is written only while the router holds the entry, so nothing is ended or billed into
the new Redis, nor by a router whose entry another took over; the gateway bills what the client
of a lost request received and writes the bills kept from finals again after a wipe. The whole
story under load is chaos Q2 (tests/chaos/test_fault_chaos.py)."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
import redis.asyncio as aioredis
from opentelemetry import trace
from redis.exceptions import ConnectionError

from gateway.losses import LossKeeper
from llmmesh import billing, queue, vocab
from llmmesh.epoch import RedisEpoch
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity, server_credentials
from llmmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from router.dispatcher import Dispatcher, DispatcherConfig
from router.ending import Ended, EndScripts
from router.policy import make_policy
from router.registry import WorkerRegistry
from tests.integration.test_router_queue import _entry


def _wipe(server) -> None:
    server.kill()
    server.start()        # the fixture's redis-server keeps nothing on disk: it comes back empty


async def _reconnected(r: aioredis.Redis) -> None:
    """The client's pooled connections died with the old server: the first call fails."""
    for _ in range(20):
        try:
            await r.ping()
            return
        except ConnectionError:
            await asyncio.sleep(0.05)


async def _client(server) -> aioredis.Redis:
    return aioredis.Redis.from_url(server.url, decode_responses=True)


def _bills(records) -> list[dict]:
    return [json.loads(fields["d"])["attributes"] for _, fields in records]


def test_the_epoch_changes_only_when_redis_lost_its_data(redis_server):
    async def body():
        r = await _client(redis_server)
        first, other = RedisEpoch(r), RedisEpoch(r)
        try:
            assert not await first.observe() and not await other.observe()
            assert first.value == other.value        # the first one founded it, the other read it
            await r.set("llmmesh:unrelated", "1")
            assert not await first.observe() and first.generation == 0
            _wipe(redis_server)
            await _reconnected(r)
            assert await first.observe() and first.generation == 1
            assert not await first.observe()          # told once
            assert await other.observe() and other.value == first.value
        finally:
            await r.aclose()
    asyncio.run(body())


def _pending_entry(cls: str = "interactive", consumer: str = "router-a"):
    """Adds an entry and delivers it to `consumer`; returns its id."""
    async def add(r: aioredis.Redis) -> str:
        stream = queue.queue_stream(cls)
        await r.xgroup_create(stream, queue.ROUTER_GROUP, id="0", mkstream=True)
        entry_id = await r.xadd(stream, {"d": "{}"})
        await r.xreadgroup(queue.ROUTER_GROUP, consumer, {stream: ">"}, count=1)
        return entry_id
    return add


def test_an_end_is_written_while_the_router_holds_the_entry_and_refused_after(redis_server):
    async def body():
        r = await _client(redis_server)
        try:
            end = dict(request_class="interactive", request_id="acme/x/1",
                       event=queue.final_event("stop", {"completion_tokens": 1}),
                       bill={"d": "bill-1"})
            entry_id = await _pending_entry()(r)
            assert await EndScripts(r).write_end(entry_id=entry_id, consumer="router-a", **end) is Ended.WRITTEN
            assert len(await r.xrange(queue.result_stream("acme/x/1"))) == 1
            assert [f["d"] for _, f in await r.xrange(billing.BILLING_STREAM)] == ["bill-1"]
            # Another router took the entry over: this one's end is refused, nothing written.
            await r.xclaim(queue.queue_stream("interactive"), queue.ROUTER_GROUP, "router-b", 0,
                           [entry_id])
            assert await EndScripts(r).write_end(entry_id=entry_id, consumer="router-a",
                                   **end) is Ended.TAKEN_OVER
            # An error event alone, and a bill alone, by the owner.
            assert await EndScripts(r).write_end(entry_id=entry_id, consumer="router-b",
                                   **{**end, "bill": None}) is Ended.WRITTEN
            assert await EndScripts(r).write_end(entry_id=entry_id, consumer="router-b",
                                   **{**end, "event": None}) is Ended.WRITTEN
            assert len(await r.xrange(queue.result_stream("acme/x/1"))) == 2
            assert len(await r.xrange(billing.BILLING_STREAM)) == 2
            # Redis lost its data: no group, no entry, nothing written into the new one.
            _wipe(redis_server)
            await _reconnected(r)
            assert await EndScripts(r).write_end(entry_id=entry_id, consumer="router-b",
                                   **end) is Ended.ENTRY_GONE
            await r.xgroup_create(queue.queue_stream("interactive"), queue.ROUTER_GROUP, id="0",
                                  mkstream=True)           # a group again, but not the entry
            assert await EndScripts(r).write_end(entry_id=entry_id, consumer="router-b",
                                   **end) is Ended.ENTRY_GONE
            assert await r.xlen(billing.BILLING_STREAM) == 0
            assert await r.exists(queue.result_stream("acme/x/1")) == 0
        finally:
            await r.aclose()
    asyncio.run(body())


def test_the_heartbeat_renews_only_entries_still_this_routers(redis_server):
    """A router that stalled past --claim-idle-ms used to XCLAIM every entry it held, taking
    back those another router had taken over (the two then swapped them at every beat)."""
    async def body():
        r = await _client(redis_server)
        try:
            scripts, stream = EndScripts(r), queue.queue_stream("interactive")
            kept = await _pending_entry()(r)
            taken = await r.xadd(stream, {"d": "{}"})
            await r.xreadgroup(queue.ROUTER_GROUP, "router-a", {stream: ">"}, count=1)
            await r.xclaim(stream, queue.ROUTER_GROUP, "router-b", 0, [taken])
            assert await scripts.renew(request_class="interactive", consumer="router-a",
                                       entry_ids=[kept, taken, "1-1"]) == [taken, "1-1"]
            owners = {p["message_id"]: p["consumer"] for p in await r.xpending_range(
                stream, queue.ROUTER_GROUP, min="-", max="+", count=10)}
            assert owners == {kept: "router-a", taken: "router-b"}
        finally:
            await r.aclose()
    asyncio.run(body())


class GatedWorker(worker_pb2_grpc.WorkerServiceServicer):
    """Holds every Generate until `release` is set, then ends it (no tokens)."""

    def __init__(self):
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def Generate(self, request, context):
        self.started.set()
        await self.release.wait()
        yield worker_pb2.WorkerGenerateResponse(final=worker_pb2.WorkerFinal(
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids))))

    async def GetLoad(self, request, context):
        return worker_pb2.GetLoadResponse(models=["m"], device_type="cpu")

    async def Abort(self, request, context):
        self.release.set()
        return worker_pb2.AbortResponse(aborted=True)


@pytest.mark.parametrize("abort", [False, True], ids=["ends-on-its-own", "aborted-by-the-router"])
def test_a_request_running_when_redis_lost_its_data_is_neither_ended_nor_billed(redis_server, abort):
    """Before router.ending, its final and full bill went into the new Redis (chaos Q2: billed
    though its client was told UNAVAILABLE). With the epoch watcher running, the router also
    aborts it on its worker at once instead of letting it run out."""
    async def body():
        worker = GatedWorker()
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
        port = server.add_secure_port("127.0.0.1:0",
                                      server_credentials(MeshIdentity.from_env(Role.WORKER)))
        await server.start()
        r = await _client(redis_server)
        registry = WorkerRegistry(r, MeshIdentity.from_env(Role.ROUTER))
        registry._add({"worker_id": "w1", "address": f"127.0.0.1:{port}", "max_inflight": 8,
                       "models": [{"name": "m", "state": "loaded"}]})
        d = Dispatcher(r, registry, make_policy("least-load"),
                       DispatcherConfig(consumer="router-a", block_ms=50), trace.get_tracer("t"))
        tasks = [asyncio.create_task(d.run())]
        if abort:
            tasks.append(asyncio.create_task(d.watch_epoch()))
        try:
            await d.ensure_groups()
            await d.epoch.observe()
            await r.xadd(queue.queue_stream("interactive"),
                         _entry("acme/lost/1", "interactive", time.time_ns()).encode())
            await asyncio.wait_for(worker.started.wait(), 10)
            _wipe(redis_server)
            await _reconnected(r)
            if abort:   # the watcher notices within a second and aborts it
                await asyncio.wait_for(worker.release.wait(), 5)
            else:
                await asyncio.sleep(1.0)
                worker.release.set()
            deadline = time.monotonic() + 5
            while d.running and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not d.running
            assert await r.xlen(billing.BILLING_STREAM) == 0
            assert await r.xrange(queue.result_stream("acme/lost/1")) == []
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await registry.close()
            await r.aclose()
            await server.stop(0)
    asyncio.run(body())


def test_the_gateway_bills_what_a_lost_requests_client_got_and_rewrites_kept_bills(redis_server):
    async def body():
        r = await _client(redis_server)
        keeper = LossKeeper(r)
        watcher = asyncio.create_task(keeper.watch())
        try:
            entry = _entry("acme/gone/1", "interactive", time.time_ns())
            await keeper.bill_lost(entry, 0)                # no token reached the client: no bill
            assert await r.xlen(billing.BILLING_STREAM) == 0
            await keeper.bill_lost(entry, 5)
            [bill] = _bills(await r.xrange(billing.BILLING_STREAM))
            assert (bill[vocab.REQUEST_ID], bill[vocab.TENANT_ID], bill[vocab.OUTPUT_TOKENS],
                    bill[vocab.INPUT_TOKENS]) == ("acme/gone/1", "acme", 5, 3)
            keeper.finished("acme/done/2", billing.encode_record(
                {vocab.REQUEST_ID: "acme/done/2"}, start_unix_ns=1, end_unix_ns=2)["d"])
            keeper.finished("acme/done/3", None)            # a final without a bill: nothing kept
            await asyncio.sleep(0.7)                        # the watcher has seen the epoch
            _wipe(redis_server)
            deadline = time.monotonic() + 5
            while await _len_or_zero(r) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert sorted(b[vocab.REQUEST_ID] for b in
                          _bills(await r.xrange(billing.BILLING_STREAM))) == ["acme/done/2",
                                                                              "acme/gone/1"]
            assert keeper.epoch.generation == 1
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await r.aclose()
    asyncio.run(body())


async def _len_or_zero(r: aioredis.Redis) -> int:
    try:
        return await r.xlen(billing.BILLING_STREAM)
    except Exception:   # noqa: BLE001 - Redis still starting
        return 0


def test_recent_bills_are_bounded_by_count_and_age():
    bills = billing.RecentBills(max_records=3, max_age_s=60)
    for i in range(5):
        bills.remember(f"r{i}", {"d": str(i)})
    assert len(bills) == 3
    bills.remember("r2", {"d": "again"})    # kept once, as the newest
    assert len(bills) == 3
    aged = billing.RecentBills(max_records=10, max_age_s=0.05)
    aged.remember("old", {"d": "x"})
    time.sleep(0.1)
    aged.remember("new", {"d": "y"})
    assert len(aged) == 1
