"""Router failure paths with real redis, costd, router and gateway processes and in-test
WorkerServices that fail on purpose (no model needed): dead-lettering after 3 failed attempts,
an expired deadline that never reaches a worker, a worker that dies after appending tokens to
the result stream itself (mid-request, and after its marked last chunk), an entry taken over
after its request had ended, and the result stream refusing a second writer of an index."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from concurrent import futures

import grpc
import pytest
import redis
import redis.asyncio as aioredis

from llmmesh import mtls, queue
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity
from llmmesh.launcher import Mesh
from llmmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e.meshkit import DEMO_KEYS, auth, chat, wait_until


class FailingWorker(worker_pb2_grpc.WorkerServiceServicer):
    """Registers like a worker, then fails every Generate with UNAVAILABLE."""

    def __init__(self):
        self.calls = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(self, self.server)
        self.port = self.server.add_secure_port(
            "127.0.0.1:0", mtls.server_credentials(MeshIdentity.from_env(Role.WORKER)))
        self.server.start()

    def register(self, redis_url: str, worker_id: str = "failing", max_inflight: int = 4) -> None:
        info = {"worker_id": worker_id, "address": f"127.0.0.1:{self.port}",
                "model": "smollm2-135m-instruct", "max_inflight": max_inflight, "device_type": "cpu"}
        redis.Redis.from_url(redis_url).set(queue.worker_key(worker_id), json.dumps(info), ex=60)

    def Generate(self, request, context):
        self.calls += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "injected failure")

    def GetLoad(self, request, context):
        return worker_pb2.GetLoadResponse(models=["smollm2-135m-instruct"], device_type="cpu")

    def Abort(self, request, context):
        return worker_pb2.AbortResponse(aborted=False)


@pytest.fixture
def mesh(tmp_path):
    m = Mesh(var_dir=str(tmp_path))
    try:
        asyncio.run(m.up(num_workers=0, timeout_s=60))
        yield m
    finally:
        m.down()


@pytest.fixture
def failing():
    worker = FailingWorker()
    yield worker
    worker.server.stop(0)


def _stub(mesh):
    return gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(mesh.procs["gateway"].address))


def _pending(mesh) -> int:
    r = redis.Redis.from_url(mesh.redis_url)
    return sum(r.xpending(queue.queue_stream(c), queue.ROUTER_GROUP)["pending"] for c in queue.CLASSES)


def test_request_failing_on_3_workers_is_dead_lettered_and_the_client_told(mesh, failing):
    failing.register(mesh.redis_url)
    with pytest.raises(grpc.RpcError) as info:
        _stub(mesh).Complete(gateway_pb2.CompleteRequest(request=chat("Hello?", 4)),
                             metadata=auth(DEMO_KEYS["acme"]), timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "3 workers" in info.value.details()
    assert failing.calls == 3
    dead = redis.Redis.from_url(mesh.redis_url).xrange(queue.DEAD_LETTER_STREAM)
    assert len(dead) == 1
    record = {k.decode(): v.decode() for k, v in dead[0][1].items()}
    assert record["tenant_id"] == "acme" and record["reason"] == "failed on 3 workers"
    assert "d" not in record and "prompt_token_ids" not in record   # no prompt kept
    wait_until(lambda: _pending(mesh) == 0, 10, what="the entry to be acknowledged")


def test_expired_deadline_never_reaches_a_worker(mesh, failing):
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:  # no worker yet: the request waits in the router
        _stub(mesh).Complete(gateway_pb2.CompleteRequest(request=chat("Hello?", 4)),
                             metadata=auth(DEMO_KEYS["acme"]), timeout=1.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5
    failing.register(mesh.redis_url)  # now a worker appears; the stale entry must not run
    wait_until(lambda: _pending(mesh) == 0, 15, what="the expired entry to be acknowledged")
    assert failing.calls == 0
    events = redis.Redis.from_url(mesh.redis_url, decode_responses=True).keys(queue.result_stream("*"))
    codes = [queue.decode_event(f)["code"] for k in events
             for _, f in redis.Redis.from_url(mesh.redis_url, decode_responses=True).xrange(k)
             if queue.decode_event(f)["kind"] == "error"]
    assert codes == ["DEADLINE_EXCEEDED"]


def _signer(request) -> dict:
    """How a real worker signs what it appends: its attempt's number and key (llmmesh.streamauth)."""
    return {"attempt": request.attempt, "key": request.attempt_key}


def _append_three_tokens_and_die(redis_url: str, request, context) -> None:
    """A worker that appended tokens 11, 12, 13 to the result stream itself, then died."""
    r = redis.Redis.from_url(redis_url)
    for i, token in enumerate([11, 12, 13]):
        r.xadd(request.result_stream, queue.tokens_event(i, [token], **_signer(request)),
               id=queue.token_entry_id(i))
    context.abort(grpc.StatusCode.UNAVAILABLE, "died after 3 tokens")


def _two_tokens_then_stop(request):
    """Tokens 14, 15 in the gRPC stream (as a direct caller gets them), then the final."""
    yield worker_pb2.WorkerGenerateResponse(tokens=worker_pb2.WorkerTokens(
        index=request.start_index, token_ids=[14, 15]))
    yield worker_pb2.WorkerGenerateResponse(final=worker_pb2.WorkerFinal(
        finish_reason=common_pb2.FINISH_REASON_STOP,
        usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=2)))


class HandoffWorker(FailingWorker):
    """The first call anywhere appends 3 tokens to the request's result stream itself (as real
    workers do) and then dies; later calls send their tokens in the gRPC stream (as a direct
    caller gets them), which the router must append after the first worker's."""

    shared: dict = {}

    def __init__(self, redis_url: str):
        super().__init__()
        self.redis_url = redis_url

    def Generate(self, request, context):
        HandoffWorker.shared.setdefault("calls", []).append(request)
        if len(HandoffWorker.shared["calls"]) == 1:
            _append_three_tokens_and_die(self.redis_url, request, context)
        yield from _two_tokens_then_stop(request)


def test_worker_dying_after_appending_tokens_itself_resumes_after_them(mesh):
    HandoffWorker.shared.clear()
    workers = [HandoffWorker(mesh.redis_url) for _ in range(2)]
    try:
        for i, w in enumerate(workers):
            w.register(mesh.redis_url, f"handoff{i}")
        done = _stub(mesh).Complete(gateway_pb2.CompleteRequest(request=chat("Hello?", 8)),
                                    metadata=auth(DEMO_KEYS["acme"]), timeout=60)
    finally:
        for w in workers:
            w.server.stop(0)
    first, second = HandoffWorker.shared["calls"]
    assert first.result_stream == queue.result_stream(first.request_id)
    # The retry continues from what the stream holds: no token twice, none lost.
    assert list(done.token_ids) == [11, 12, 13, 14, 15]
    assert second.start_index == 3 and second.sampling.max_tokens == 8 - 3
    assert list(second.prompt_token_ids) == list(first.prompt_token_ids) + [11, 12, 13]
    assert done.final.usage.completion_tokens == 5


class SeatWorker(FailingWorker):
    """One slot. `dies`: every call appends 3 tokens to the result stream, then fails. Otherwise
    the first call holds its slot until `release` is set; later calls send 2 tokens and end."""

    def __init__(self, redis_url: str, dies: bool):
        super().__init__()
        self.redis_url, self.dies = redis_url, dies
        self.release = threading.Event()
        self.requests = []

    def Generate(self, request, context):
        self.requests.append(request)
        if self.dies:
            _append_three_tokens_and_die(self.redis_url, request, context)
        if len(self.requests) == 1:
            self.release.wait(60)
        yield from _two_tokens_then_stop(request)


def test_a_request_broken_off_mid_stream_resumes_on_a_full_worker_at_once(mesh):
    """The only surviving worker has no free slot: a request whose worker died after delivering
    tokens resumes there at once (its client waits between two tokens), instead of waiting
    behind the slot cap like new work (the worker's engine seats it ahead of its queue)."""
    survivor, dying = SeatWorker(mesh.redis_url, dies=False), SeatWorker(mesh.redis_url, dies=True)
    try:
        survivor.register(mesh.redis_url, "survivor", max_inflight=1)
        with futures.ThreadPoolExecutor(1) as pool:
            blocker = pool.submit(_stub(mesh).Complete, gateway_pb2.CompleteRequest(
                request=chat("Hold the slot.", 8)), metadata=auth(DEMO_KEYS["acme"]), timeout=90)
            wait_until(lambda: len(survivor.requests) == 1, 30, what="the survivor's slot taken")
            dying.register(mesh.redis_url, "dying", max_inflight=1)
            started = time.monotonic()
            done = _stub(mesh).Complete(gateway_pb2.CompleteRequest(request=chat("Hello?", 8)),
                                        metadata=auth(DEMO_KEYS["acme"]), timeout=30)
            took = time.monotonic() - started
            assert not blocker.done()      # the survivor's slot was still taken throughout
            survivor.release.set()
            blocker.result()
    finally:
        survivor.release.set()
        for w in (survivor, dying):
            w.server.stop(0)
    assert list(done.token_ids) == [11, 12, 13, 14, 15]
    resumed = survivor.requests[1]
    assert resumed.start_index == 3 and len(dying.requests) == 1
    assert took < 10, took


def test_result_stream_refuses_a_second_writer_of_an_index(redis_server):
    async def run():
        r = aioredis.Redis.from_url(redis_server.url)
        stream = queue.result_stream("fence")
        await queue.append_tokens(r, stream, 0, [1, 2])
        await queue.append_tokens(r, stream, 2, [3])
        with pytest.raises(queue.IndexTaken):       # a replaced attempt writing index 2 again
            await queue.append_tokens(r, stream, 2, [9])
        with pytest.raises(queue.IndexTaken):       # or an earlier one
            await queue.append_tokens(r, stream, 1, [9])
        await r.xadd(stream, queue.final_event("stop", {}))
        with pytest.raises(queue.IndexTaken):       # nothing after the final
            await queue.append_tokens(r, stream, 3, [4])
        events = [queue.decode_event(f) for _, f in await r.xrange(stream)]
        await r.aclose()
        return events
    events = asyncio.run(run())
    assert [(e["kind"], e.get("ids")) for e in events] == [
        ("tokens", [1, 2]), ("tokens", [3]), ("final", None)]


def test_duplicate_request_id_is_refused_without_touching_the_first_ones_reservation(tmp_path):
    """A request id re-sent while the first request waits (no worker yet) gets ALREADY_EXISTS;
    the budget still holds exactly the first request's reservation, and settling the first
    later releases it fully. Redis's script cache is flushed in between, so admission also
    goes through its reload path."""
    from tests.e2e.meshkit import tenants_file
    m = Mesh(var_dir=str(tmp_path), gateway_args=["--tenants", tenants_file(tmp_path / "t.toml", 10_000)])
    try:
        asyncio.run(m.up(num_workers=0, timeout_s=60))
        stub, r = _stub(m), redis.Redis.from_url(m.redis_url, decode_responses=True)
        req = chat("Hello?", 7)
        req.request_id = "dup-1"
        key = auth("llmmesh-test-capped")
        first = futures.ThreadPoolExecutor(1).submit(
            lambda: stub.Complete(gateway_pb2.CompleteRequest(request=req), metadata=key, timeout=4))
        claim = queue.claim_key("capped", "dup-1")
        wait_until(lambda: r.exists(claim), 10, what="the first request to be queued")
        budget = [k for k in r.keys(f"{queue.PREFIX}:budget:*")]
        assert len(budget) == 1
        reserved = int(r.hget(budget[0], "reserved"))
        assert reserved > 7
        r.script_flush()
        with pytest.raises(grpc.RpcError) as info:
            stub.Complete(gateway_pb2.CompleteRequest(request=req), metadata=key, timeout=10)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup-1" in info.value.details()
        assert int(r.hget(budget[0], "reserved")) == reserved   # the second's was released
        with pytest.raises(grpc.RpcError) as info:
            first.result()
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # A worker appears: the router ends the expired entry and settles its reservation,
        # which must release all of it (a shared settle marker used to make this a no-op).
        worker = FailingWorker()
        try:
            worker.register(m.redis_url)
            wait_until(lambda: _pending(m) == 0, 15, what="the expired entry to be acknowledged")
        finally:
            worker.server.stop(0)
        assert int(r.hget(budget[0], "reserved")) == 0 and int(r.hget(budget[0], "used") or 0) == 0
    finally:
        m.down()


class AbortableWorker(FailingWorker):
    """Waits 0.5 s before its one token unless aborted; an aborted call ends with a cancelled
    final, as a real worker's does."""

    def __init__(self):
        super().__init__()
        self.aborts: dict[str, threading.Event] = {}
        self.aborted: list[str] = []

    def Generate(self, request, context):
        self.calls += 1
        abort = self.aborts.setdefault(request.request_id, threading.Event())
        if abort.wait(0.5):
            yield worker_pb2.WorkerGenerateResponse(final=worker_pb2.WorkerFinal(
                finish_reason=common_pb2.FINISH_REASON_CANCELLED,
                usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids))))
            return
        yield worker_pb2.WorkerGenerateResponse(tokens=worker_pb2.WorkerTokens(
            index=request.start_index, token_ids=[14]))
        yield worker_pb2.WorkerGenerateResponse(final=worker_pb2.WorkerFinal(
            finish_reason=common_pb2.FINISH_REASON_STOP,
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=1)))

    def Abort(self, request, context):
        abort = self.aborts.get(request.request_id)
        if abort is None:          # not started here yet: the router asks again
            return worker_pb2.AbortResponse(aborted=False)
        abort.set()
        self.aborted.append(request.request_id)
        return worker_pb2.AbortResponse(aborted=True)


def test_interactive_request_cancelled_while_queued_is_aborted_unbilled(mesh):
    """The client goes away while its request waits for a worker. When one appears, the router
    (which checks the cancel key beside the worker call, not before it) aborts the work and
    ends the request as CANCELLED with nothing delivered, so nothing is billed; the next
    request on that worker completes."""
    stub = _stub(mesh)
    r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    call = stub.Generate(chat("Hello?", 8), metadata=auth(DEMO_KEYS["acme"]), timeout=60)
    wait_until(lambda: r.keys(f"{queue.PREFIX}:req:*"), 10, what="the request to be queued")
    (claim,) = r.keys(f"{queue.PREFIX}:req:*")
    request_id = r.get(claim)   # the mesh's id for the request
    call.cancel()                                    # the gateway records and publishes it
    wait_until(lambda: r.exists(queue.cancel_key(request_id)), 10, what="the cancel to be recorded")
    worker = AbortableWorker()
    try:
        worker.register(mesh.redis_url)
        wait_until(lambda: _pending(mesh) == 0, 15, what="the cancelled entry to be acknowledged")
        assert worker.calls == 1 and worker.aborted == [request_id]
        events = [queue.decode_event(f) for _, f in r.xrange(queue.result_stream(request_id))]
        assert [(e["kind"], e.get("code")) for e in events] == [("error", "CANCELLED")]
        done = stub.Complete(gateway_pb2.CompleteRequest(request=chat("Hi?", 4)),
                             metadata=auth(DEMO_KEYS["acme"]), timeout=30)
        assert list(done.token_ids) == [14] and done.final.usage.completion_tokens == 1
        assert worker.calls == 2 and len(worker.aborted) == 1
        # Ended entries leave the queue stream (its length is what the gateway's bound counts).
        wait_until(lambda: r.xlen(queue.queue_stream("interactive")) == 0, 10,
                   what="the ended entries to leave the queue")
    finally:
        worker.server.stop(0)


class EndingWorker(FailingWorker):
    """Writes the whole completion to the result stream itself, its last chunk marked as the
    end (as real workers do), then dies before its final message reaches the router."""

    code = grpc.StatusCode.UNAVAILABLE

    def Generate(self, request, context):
        self.calls += 1
        r = redis.Redis.from_url(self.redis_url)
        r.xadd(request.result_stream, queue.tokens_event(0, [11, 12], **_signer(request)),
               id=queue.token_entry_id(0))
        end = {"finish_reason": "stop", "usage": {"cached_prompt_tokens": 0, "queue_s": 0.0,
                                                  "prefill_device_s": 0.25, "decode_device_s": 0.5}}
        r.xadd(request.result_stream, queue.tokens_event(2, [13], end=end, **_signer(request)),
               id=queue.token_entry_id(2))
        context.abort(self.code, "died before its final")


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_worker_dying_after_its_last_chunk_is_not_run_again(mesh, failing, code):
    """The end marker on the last chunk tells the router the request is done: it writes the
    final (stop, 3 tokens, the worker's device time) and calls no second worker, whether the
    call then broke retryably or not (a deadline firing between the last chunk and the final).
    Without the marker (test above) the same break resumes on another worker."""
    ending = EndingWorker()
    ending.code = code
    ending.redis_url = mesh.redis_url
    try:
        ending.register(mesh.redis_url, "ending")
        done = _stub(mesh).Complete(gateway_pb2.CompleteRequest(request=chat("Hello?", 8)),
                                    metadata=auth(DEMO_KEYS["acme"]), timeout=60)
        failing.register(mesh.redis_url)   # would fail the request if it were run again
        time.sleep(1.0)
    finally:
        ending.server.stop(0)
    assert list(done.token_ids) == [11, 12, 13]
    assert done.final.finish_reason == common_pb2.FINISH_REASON_STOP
    assert done.final.usage.completion_tokens == 3
    assert done.final.usage.decode_device_seconds == pytest.approx(0.5)
    assert ending.calls == 1 and failing.calls == 0


@pytest.mark.parametrize("end", [True, False])
def test_taken_over_entry_that_had_ended_is_finished_not_rerun(mesh, failing, end):
    """A router died after the request's worker was done but before it wrote the final: the
    entry is pending again, and its result stream holds every token (with the worker's end
    marker, or simply max_tokens of them). The router that picks it up writes the final and
    acknowledges it; no worker is called (a call would fail: only `failing` is registered)."""
    failing.register(mesh.redis_url)
    r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)
    rid = f"ended-{end}"
    entry = queue.QueueEntry(
        request_id=rid, tenant_id="acme", request_class="batch", model="smollm2-135m-instruct",
        prompt_token_ids=[1, 2, 3], cache_salt="scope:acme", block_hashes=[],
        sampling={"max_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "stop": [],
                  "logprobs": False, "seed": None})
    stream = queue.result_stream(rid)
    r.xadd(stream, queue.tokens_event(0, [7, 8, 9]), id=queue.token_entry_id(0))
    if end:   # ended by EOS after 3 of 4 tokens: the marker is all that says so
        r.xadd(stream, queue.tokens_event(3, [], end={"finish_reason": "stop", "usage": {}}),
               id=queue.token_entry_id(3))
    else:     # all 4 tokens delivered, the last chunk's marker lost with an older worker
        r.xadd(stream, queue.tokens_event(3, [10]), id=queue.token_entry_id(3))
    r.xadd(queue.queue_stream("batch"), entry.encode())
    wait_until(lambda: _pending(mesh) == 0 and r.xlen(stream) == 3, 15,
               what="the entry to be finished")
    final = queue.decode_event(r.xrange(stream)[-1][1])
    assert final["kind"] == "final"
    assert final["finish_reason"] == ("stop" if end else "length")
    assert final["usage"]["completion_tokens"] == (3 if end else 4)
    assert failing.calls == 0


def _health(address: str, role: Role | None) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    channel = (mtls.channel(address, MeshIdentity.from_env(Role.ADMIN), role) if role
               else grpc.insecure_channel(address))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as exc:
            return exc.code().name


def test_health_says_not_serving_while_redis_is_down_and_serving_after(mesh):
    router, gateway = mesh.procs["router"].address, mesh.procs["gateway"].address
    both = lambda: (_health(router, Role.ROUTER), _health(gateway, None))  # noqa: E731
    assert both() == ("SERVING", "SERVING")
    port = int(mesh.procs["redis"].address.rsplit(":", 1)[1])
    mesh.stop_one("redis", signal.SIGKILL)
    started = time.monotonic()
    wait_until(lambda: both() == ("NOT_SERVING", "NOT_SERVING"), 5, what="NOT_SERVING")
    print(f"\n  NOT_SERVING {time.monotonic() - started:.1f}s after Redis died")
    mesh.start_redis(port)
    wait_until(lambda: both() == ("SERVING", "SERVING"), 10, what="SERVING again")
    # Admitting again: with no worker the request ends at its deadline, not in a hang.
    with pytest.raises(grpc.RpcError) as info:
        _stub(mesh).Complete(gateway_pb2.CompleteRequest(request=chat("Hello?", 2)),
                             metadata=auth(DEMO_KEYS["acme"]), timeout=3)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_failing_workers_circuit_opens_survives_lease_refreshes_and_probes_later(mesh, failing):
    """3 failed attempts open the circuit: the next request is not sent there (it ends at its
    deadline with no other worker), although the lease is renewed meanwhile; after the router's
    5 s cool-down one probe goes."""
    failing.register(mesh.redis_url, "flaky")
    stub = _stub(mesh)
    with pytest.raises(grpc.RpcError):
        stub.Complete(gateway_pb2.CompleteRequest(request=chat("Hello?", 2)),
                      metadata=auth(DEMO_KEYS["acme"]), timeout=30)
    assert failing.calls == 3
    failing.register(mesh.redis_url, "flaky")            # a fresh lease: no longer resets it
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(gateway_pb2.CompleteRequest(request=chat("Hello?", 2)),
                      metadata=auth(DEMO_KEYS["acme"]), timeout=2)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert failing.calls == 3                            # nothing went to the open circuit
    time.sleep(4)                                        # past the cool-down (5 s from opening)
    with pytest.raises(grpc.RpcError):
        stub.Complete(gateway_pb2.CompleteRequest(request=chat("Hello?", 2)),
                      metadata=auth(DEMO_KEYS["acme"]), timeout=10)
    assert failing.calls >= 4                            # the half-open probe
    assert "circuit closed -> open" in open(f"{mesh.log_dir}/router.log").read()


class OverclaimingWorker(FailingWorker):
    """Appends 2 tokens to the result stream (signed, as real workers do), then reports 10 in
    its final: a worker inflating a bill."""

    def __init__(self, redis_url: str):
        super().__init__()
        self.redis_url = redis_url

    def Generate(self, request, context):
        self.calls += 1
        r = redis.Redis.from_url(self.redis_url)
        r.xadd(request.result_stream, queue.tokens_event(0, [11, 12], **_signer(request)),
               id=queue.token_entry_id(0))
        yield worker_pb2.WorkerGenerateResponse(final=worker_pb2.WorkerFinal(
            finish_reason=common_pb2.FINISH_REASON_STOP, token_ids=list(range(11, 21)),
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids))))


def test_a_worker_reporting_more_tokens_than_it_wrote_is_billed_what_the_stream_holds(mesh):
    worker = OverclaimingWorker(mesh.redis_url)
    try:
        worker.register(mesh.redis_url, "overclaiming")
        done = _stub(mesh).Complete(gateway_pb2.CompleteRequest(request=chat("Hello?", 16)),
                                    metadata=auth(DEMO_KEYS["acme"]), timeout=60)
    finally:
        worker.server.stop(0)
    assert list(done.token_ids) == [11, 12]
    assert done.final.usage.completion_tokens == 2       # what the router bills, not 10
    assert "reported 10 tokens, its result stream holds 2" in open(
        f"{mesh.log_dir}/router.log").read()
