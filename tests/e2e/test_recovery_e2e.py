"""Failures on the real mesh: a worker or a router killed mid-stream, Redis restarted,
cancellation, budgets under a burst. Every accepted request ends once; tokens stay contiguous."""
from __future__ import annotations

import asyncio
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis

from llmmesh import queue
from llmmesh.errors import retry_delay_s
from llmmesh.launcher import Mesh
from llmmesh.models import resolve_model
from llmmesh.prefix_hash import block_hashes, cache_salt
from llmmesh.tokenizer import Tokenizer
from llmmesh.v1 import gateway_pb2, gateway_pb2_grpc
from tests.e2e.meshkit import DEMO_KEYS, StreamRecorder, auth, chat, tenants_file, wait_until, worker_load

pytestmark = [pytest.mark.e2e, pytest.mark.model]
BUDGET = 600
PROMPTS = ["Tell me a long story about a dragon.", "Describe the ocean in detail.",
           "Explain how a bicycle works.", "Write a poem about autumn leaves.",
           "List many fruits and describe each.", "Describe a busy city morning."]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    var = tmp_path_factory.mktemp("recovery")
    m = Mesh(var_dir=str(var), worker_args=["--max-num-seqs", "8"],
             router_args=["--claim-idle-ms", "3000", "--heartbeat-s", "1"],
             gateway_args=["--tenants", tenants_file(var / "tenants.toml", BUDGET)])
    try:
        asyncio.run(m.up(num_workers=2, num_routers=2, timeout_s=240))
        yield m
    finally:
        m.down()


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.procs["gateway"].address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


def _start_streams(stub, n, max_tokens=60):
    return [StreamRecorder(stub, chat(PROMPTS[i % len(PROMPTS)], max_tokens), DEMO_KEYS["acme"])
            for i in range(n)]


def _finish_all(recs, timeout_s=180):
    for r in recs:
        r.thread.join(timeout_s)
        assert not r.thread.is_alive(), "a request never ended"


def _assert_completed_once(recs):
    for r in recs:
        assert r.error is None, r.error
        assert r.final is not None
        r.assert_contiguous()
        assert len(r.token_ids) == r.final.usage.completion_tokens


def _no_pending(mesh):
    client = redis.Redis.from_url(mesh.redis_url)
    return all(client.xpending(queue.queue_stream(c), queue.ROUTER_GROUP)["pending"] == 0
               for c in queue.CLASSES)


def test_prefix_affinity_hits_for_the_same_tenant_only(mesh, stub):
    system = ("You are a meticulous assistant for a shipping company. Answer in one short "
              "sentence, cite no sources, and never invent tracking numbers. ") * 3
    req = chat("Where is my parcel?", 4)
    req.messages.insert(0, gateway_pb2.ChatMessage(role="system", content=system))

    def cached(key):
        done = stub.Complete(gateway_pb2.CompleteRequest(request=req), metadata=auth(key), timeout=60)
        return done.final.usage.cached_prompt_tokens, done.final.usage.prompt_tokens
    first, prompt_tokens = cached(DEMO_KEYS["acme"])
    assert first == 0 and prompt_tokens > 64
    time.sleep(2.5)  # let the workers publish their cache index and the routers read it
    # The shared index in Redis names exactly one worker holding this tenant's prefix.
    tok = Tokenizer.from_gguf(resolve_model().gguf_path)
    ids = tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": "Where is my parcel?"}]))
    first_block = block_hashes(ids, 16, cache_salt("acme", "smollm2-135m-instruct"))[0]
    client = redis.Redis.from_url(mesh.redis_url)
    holders = [w for w in ("worker0", "worker1")
               if client.sismember(queue.worker_cache_key(w), str(first_block))]
    assert len(holders) == 1, holders
    hits = [cached(DEMO_KEYS["acme"])[0] for _ in range(4)]
    assert all(h >= 64 for h in hits), hits  # every repeat lands where the prefix is cached
    assert cached(DEMO_KEYS["globex"])[0] == 0  # same text, other tenant: no reuse


def test_worker_killed_mid_stream_requests_resume_elsewhere(mesh, stub):
    recs = _start_streams(stub, 6, max_tokens=200)   # long enough to still run at the kill
    wait_until(lambda: all(len(r.token_ids) >= 3 for r in recs), 120, what="first tokens")
    loads = {n: worker_load(mesh.procs[n].address).num_running for n in ("worker0", "worker1")}
    victim = max(loads, key=loads.get)
    assert loads[victim] > 0
    mesh.stop_one(victim, signal.SIGKILL)
    _finish_all(recs)
    _assert_completed_once(recs)
    wait_until(lambda: _no_pending(mesh), 10, what="all entries acknowledged")
    mesh.start_worker(victim)
    asyncio.run(mesh.wait_ready([victim], 120))


def test_router_killed_its_entries_are_taken_over(mesh, stub):
    recs = _start_streams(stub, 4, max_tokens=200)   # long enough to still run at the kill
    wait_until(lambda: all(len(r.token_ids) >= 2 for r in recs), 120, what="first tokens")
    mesh.stop_one("router", signal.SIGKILL)
    _finish_all(recs)
    _assert_completed_once(recs)
    wait_until(lambda: _no_pending(mesh), 15, what="all entries acknowledged")
    # The survivor serves new work alone.
    done = stub.Complete(gateway_pb2.CompleteRequest(request=chat("Say hello.", 4)),
                         metadata=auth(DEMO_KEYS["acme"]), timeout=60)
    assert done.final.usage.completion_tokens >= 1


def test_cancel_aborts_the_work_on_the_worker(mesh, stub):
    wait_until(lambda: all(worker_load(mesh.procs[w].address).num_running == 0
                           for w in ("worker0", "worker1")), 60, what="idle workers")
    rec = StreamRecorder(stub, chat(PROMPTS[0], 200), DEMO_KEYS["acme"])
    wait_until(lambda: len(rec.token_ids) >= 2, 60, what="first tokens")
    cancelled_at = time.monotonic()
    rec.call.cancel()

    def idle():
        return all(worker_load(mesh.procs[w].address).num_running == 0 for w in ("worker0", "worker1"))
    wait_until(idle, 5, interval_s=0.005, what="the worker to drop the request")
    elapsed = time.monotonic() - cancelled_at
    assert elapsed < 0.25, f"worker still ran the request {elapsed:.3f}s after the cancel"
    assert len(rec.token_ids) < 200


def test_budget_holds_under_a_burst_of_20(mesh, stub):
    key = "llmmesh-test-capped"

    def one(i):
        try:
            done = stub.Complete(gateway_pb2.CompleteRequest(request=chat(f"Count to {i}.", 16)),
                                 metadata=auth(key), timeout=120)
            return ("ok", done.final.usage.prompt_tokens + done.final.usage.completion_tokens)
        except grpc.RpcError as exc:
            return (exc.code(), retry_delay_s(exc))
    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    used = sum(n for status, n in results if status == "ok")
    refused = [r for r in results if r[0] != "ok"]
    assert 0 < used <= BUDGET
    assert refused and all(code == grpc.StatusCode.RESOURCE_EXHAUSTED and delay and delay > 0
                           for code, delay in refused)


def test_redis_restart_gives_unavailable_then_recovers(mesh, stub):
    mesh.stop_one("redis", signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(gateway_pb2.CompleteRequest(request=chat("Say hi.", 4)),
                      metadata=auth(DEMO_KEYS["acme"]), timeout=30)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 10
    mesh.restart_redis()

    def serves():
        try:
            done = stub.Complete(gateway_pb2.CompleteRequest(request=chat("Say hi.", 4)),
                                 metadata=auth(DEMO_KEYS["acme"]), timeout=20)
            return done.final.usage.completion_tokens >= 1
        except grpc.RpcError:
            return False
    wait_until(serves, 60, interval_s=0.5, what="the mesh to serve again after the restart")
