"""Faults at dispatch on one real mesh (2 gateways, 2 routers, 2 workers): a router SIGKILLed
while it holds entries, beside poison entries (Q3); a worker SIGSTOPped and continued (F6); and
short deadlines against a slow worker (F2). Each prints sent / completed / typed errors / lost /
double-billed / unbilled tokens from the client records against the ledger
(tests/chaos/chaoskit.py) and asserts lost = double-billed = unbilled = 0 and the ledger's
tokens per tenant equal to the clients'.

The workers serve a Llama GGUF generated for the test (tests/tiny_gguf.py: 2 layers, 64 wide),
not SmolLM2: these scenarios are about the mesh's reaction to a stopped, slow or killed
process, and on 2 cores the real model's step times would set every timing here (and the
module's time in `make test`). Every forward pass is paced by LLMMESH_TEST_STEP_DELAY_MS
(workers/__main__.py): +10 ms on the mesh's workers, +120 ms on F2's slow one, so the timings do
not depend on the machine. `make test` runs them at LLMMESH_CHAOS_SCALE=1 (~45 s on 2 cores),
`make chaos` at 5 (Q3: 24 -> 120 requests; F6: the worker stopped 6 s -> 20 s; F2: 40 -> 200
requests)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis

from llmmesh import queue, streamauth
from tests.chaos.chaoskit import (LONG, SCALE, STEP_DELAY_ENV, TINY, chaos_mesh, client_stalls,
                                  gc_pauses, report, send, tiny_catalog)
from tests.e2e.meshkit import wait_until, worker_load

pytestmark = [pytest.mark.e2e]
F2_DEADLINE_S = 0.3
MESH_STEP_DELAY_MS = 10
F2_STEP_DELAY_MS = 120     # a slow device: 2 tokens at most within F2's deadline
F6_STOP_S = 20.0 if SCALE >= 5 else 6.0


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    var = tmp_path_factory.mktemp("dispatch-chaos")
    catalog = tiny_catalog(var, seed=3, kv_cache_mib=16)
    # Unpaced, the tiny model ends a request before a SIGSTOP can catch it on its worker (F6
    # never saw 2 running); 10 ms a step keeps a 96-token request there for about a second.
    with chaos_mesh(var, workers=2, gateways=2,
                    worker_args=["--catalog", catalog, "--max-num-seqs", "8"],
                    gateway_args=["--catalog", catalog],
                    env={STEP_DELAY_ENV: str(MESH_STEP_DELAY_MS)}) as m:
        yield m


def _redis(mesh) -> redis.Redis:
    return redis.Redis.from_url(mesh.redis_url, decode_responses=True)


def _circuit(mesh, router: str, worker: str) -> str | None:
    """The circuit state `router` holds for `worker` (its metrics), None if it knows no such
    worker (its lease lapsed)."""
    url = f"http://{mesh.procs[router].metrics_address}/metrics"
    with urllib.request.urlopen(url, timeout=2) as reply:
        text = reply.read().decode()
    # prometheus_client writes labels sorted by name.
    found = re.search(rf'llmmesh_worker_circuit_state\{{state="(\w+)",worker="{worker}"\}} 1\.0',
                      text)
    return found.group(1) if found else None


def _running(mesh, name: str) -> int:
    try:
        return worker_load(mesh.procs[name].address).num_running
    except grpc.RpcError:
        return -1


def _ensure(mesh, *names: str) -> None:
    for name in names:
        if not mesh.procs[name].alive():
            if name.startswith("router"):
                mesh.start_service(name, "router", ["--consumer", name, *mesh.router_args])
            else:
                mesh.start_worker(name)
            asyncio.run(mesh.wait_ready([name], 240))


# -- Q3 ---------------------------------------------------------------------------------------

KEY = streamauth.new_stream_key()


def _poison(cls: str, request_id: str, **overrides) -> dict[str, str]:
    body = {"request_id": request_id, "tenant_id": "acme", "request_class": cls, "model": TINY,
            "prompt_token_ids": [104, 101, 108, 108, 111], "cache_salt": "acme",
            "block_hashes": [], "sampling": {"max_tokens": 4},
            "enqueued_unix_ns": time.time_ns()}
    body.update(overrides)
    return {"d": json.dumps(body)}


def test_q3_router_killed_holding_entries_and_poison_entries_dead_lettered(mesh):
    """router is SIGKILLed while it holds entries: router1 takes them over and every request
    ends once. Beside the load, two poison entries: one whose fields have the wrong types (it
    cannot be held at all: dead-lettered at its first delivery, and it must not stop the
    entries claimed with it from being served), and one that decodes but makes dispatch fail
    (its sampling lacks what a worker needs): it is delivered again and again, counted by Redis
    (XPENDING), and dead-lettered after its third delivery, whichever routers held it. The
    dead-letter stream keeps no prompt and stays bounded."""
    _ensure(mesh, "router", "router1", "worker0", "worker1")
    r = _redis(mesh)
    stream = queue.queue_stream("interactive")
    # A dead-letter stream already at its bound: the poison's records must not grow it.
    with r.pipeline(transaction=False) as pipe:
        for i in range(queue.DEAD_LETTER_MAXLEN + 300):
            pipe.xadd(queue.DEAD_LETTER_STREAM, {"entry_id": f"old-{i}", "reason": "filler"})
        pipe.execute()
    n = 24 * SCALE
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(send, mesh, n, "q3", max_tokens=24, concurrency=12, timeout_s=60)

        def router_holds_entries():
            return any(c["name"] == "router" and int(c["pending"]) >= 3
                       for c in r.xpending(stream, queue.ROUTER_GROUP)["consumers"])
        wait_until(router_holds_entries, 60, interval_s=0.01, what="router to hold entries")
        malformed = r.xadd(stream, _poison("interactive", "acme/q3poison-0/x",
                                           prompt_token_ids=5, sampling=[], stream_key=KEY))
        failing = r.xadd(stream, _poison("interactive", "acme/q3poison-1/x"))
        killed = time.monotonic()
        mesh.stop_one("router", signal.SIGKILL)
        # Started again at once: the two live routers race for the takeovers, so the failing
        # entry's deliveries are spread over routers that share no memory of it.
        mesh.start_service("router", "router", ["--consumer", "router", *mesh.router_args])
        results = sending.result(timeout=300)

    def dead_letter(entry_id):
        return next((f for _, f in r.xrevrange(queue.DEAD_LETTER_STREAM, count=50)
                     if f.get("entry_id") == entry_id), None)
    wait_until(lambda: dead_letter(malformed) and dead_letter(failing), 60, interval_s=0.2,
               what="both poison entries dead-lettered")
    dead_s = time.monotonic() - killed
    bad, fail = dead_letter(malformed), dead_letter(failing)
    events = r.xrange(queue.result_stream("acme/q3poison-1/x"))
    end = queue.decode_event(events[-1][1]) if events else None
    logs = {name: open(f"{mesh.log_dir}/{name}.log").read() for name in ("router", "router1")}
    took_over = {name: log.count("took over") for name, log in logs.items()}
    failed_on = {name: log.count(f"entry {failing}, delivery") for name, log in logs.items()}
    print(f"\n  Q3: entries taken over by router: {took_over}; malformed entry "
          f"dead-lettered at delivery {bad['deliveries']}, failing one at delivery "
          f"{fail['deliveries']} ({dead_s:.1f} s after the kill; failed deliveries by router: "
          f"{failed_on}); dead-letter stream "
          f"{r.xlen(queue.DEAD_LETTER_STREAM)} records (bound {queue.DEAD_LETTER_MAXLEN})")
    assert sum(took_over.values()) >= 3, took_over   # the killed router held 3 or more
    # Dead-lettered by the first live router that read it: the killed one may have read it.
    assert int(bad["deliveries"]) <= 2, bad
    # Its client is told, in an event its gateway accepts (signed with the router's key).
    told = r.xrange(queue.result_stream("acme/q3poison-0/x"))
    check = streamauth.StreamCheck(KEY, "acme/q3poison-0/x")
    assert told and (check.accept(told[-1][1]) or {}).get("kind") == "error", told
    # Three deliveries ran and failed; the fourth is not run but dead-lettered.
    assert int(fail["deliveries"]) == queue.MAX_DELIVERIES + 1, fail
    # Each of them logged by the router it failed on (the killed one may have died first).
    assert 2 <= sum(failed_on.values()) <= queue.MAX_DELIVERIES, failed_on
    assert end is not None and end["kind"] == "error" and end["code"] == "UNAVAILABLE", end
    for record in (bad, fail):
        assert not {"d", "prompt_token_ids", "sampling", "prompt"} & set(record), record
        assert "104, 101" not in str(record) and "hello" not in str(record), record
    # XADD MAXLEN ~ trims whole macro nodes (100 entries each): the bound plus one node.
    assert r.xlen(queue.DEAD_LETTER_STREAM) <= queue.DEAD_LETTER_MAXLEN + 100
    assert r.xpending(stream, queue.ROUTER_GROUP)["pending"] == 0
    assert all(o.usage is not None for o in results), [o for o in results if o.usage is None]
    report("Q3: a router SIGKILLed holding entries, beside poison entries (tiny model)",
           results, mesh, "q3")


# -- F6 ---------------------------------------------------------------------------------------

def test_f6_a_worker_sigstopped_opens_its_circuit_and_closes_it_after_sigcont(mesh):
    """worker1 is SIGSTOPped with requests in flight on it for F6_STOP_S, then continued: its
    requests move to worker0 before it comes back (keepalive finds the stopped peer), none
    waits past its deadline, the routers open worker1's circuit while it is stopped and close
    it again after."""
    _ensure(mesh, "router", "router1", "worker0", "worker1")
    deadline_s = 30.0
    pid = mesh.procs["worker1"].popen.pid
    seen: dict[str, set[str]] = {"router": set(), "router1": set()}
    num_open_loop = int((F6_STOP_S + 2.0) / 0.25)
    with ThreadPoolExecutor(2) as pool:
        # A burst that fills both workers, then an open loop (4 a second) over the stop.
        burst = pool.submit(send, mesh, 16, "f6", max_tokens=96, concurrency=16,
                            timeout_s=deadline_s, prompt=LONG)
        wait_until(lambda: _running(mesh, "worker1") >= 3, 60, interval_s=0.01,
                   what="worker1 to run requests")
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            loop = pool.submit(send, mesh, num_open_loop, "f6-loop", max_tokens=16,
                               concurrency=num_open_loop, timeout_s=deadline_s, interval_s=0.25)
            while time.monotonic() - stopped < F6_STOP_S:
                for router in seen:
                    seen[router].add(_circuit(mesh, router, "worker1") or "gone")
                time.sleep(0.2)
        finally:
            os.kill(pid, signal.SIGCONT)
            continued = time.monotonic()
        results = burst.result(timeout=300) + loop.result(timeout=300)
    # Traffic after SIGCONT until both circuits close: after its cool-down (--breaker-open-s,
    # 5 s) each router sends worker1 one probe request, and its success closes the circuit.
    after = []
    while not all(_circuit(mesh, r, "worker1") == "closed" for r in seen):
        assert time.monotonic() - continued < 30, (
            "worker1's circuits did not close", {r: _circuit(mesh, r, "worker1") for r in seen})
        after += send(mesh, 4, f"f6-after{len(after)}", max_tokens=8, timeout_s=deadline_s)
        time.sleep(0.25)
    closed_s = time.monotonic() - continued
    worst = max(o.seconds for o in results + after)
    worst_gap = max(o.max_gap_s for o in results)
    lapsed = any("gone" in v for v in seen.values())
    print(f"\n  F6: worker1 stopped {F6_STOP_S:.0f} s; circuit states seen while stopped "
          f"{ {k: sorted(v) for k, v in seen.items()} }"
          f"{' (gone: its lease lapsed, it rejoined closed)' if lapsed else ''}; closed on both "
          f"routers {closed_s:.1f} s after SIGCONT; "
          f"longest request {worst:.2f} s (deadline {deadline_s:.0f} s), longest pause between "
          f"two messages {worst_gap:.2f} s")
    assert all(o.seconds < deadline_s for o in results + after), worst
    # Moved off the stopped worker before it came back, not when it did.
    assert worst_gap < F6_STOP_S - 0.25, worst_gap
    assert any("open" in v for v in seen.values()), seen
    report(f"F6: a worker SIGSTOPped {F6_STOP_S:.0f} s, then SIGCONT (tiny model)",
           results + after, mesh, "f6")
    log = open(f"{mesh.log_dir}/router.log").read() + open(f"{mesh.log_dir}/router1.log").read()
    assert "circuit closed -> open" in log


# -- F2 ---------------------------------------------------------------------------------------

def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else 0.0


def _server_overshoot_ms(mesh, outcomes, tag: str) -> list[float]:
    """For each request, how long after its deadline the router wrote its error event (the
    event's entry id is Redis's clock in ms; the deadline is the client's start + 300 ms, on
    the same host's clock)."""
    r = _redis(mesh)
    by_client = {o.client_id: o for o in outcomes}
    offset = time.time() - time.monotonic()
    out = []
    for key in r.scan_iter(match=f"{queue.PREFIX}:res:{{*/{tag}-*", count=1000):
        client_id = key.split("/")[1]
        o = by_client.get(client_id)
        events = r.xrange(key)
        if o is None or not events:
            continue
        last_id, fields = events[-1]
        if queue.decode_event(fields)["kind"] == "error":
            ended_s = int(last_id.split("-")[0]) / 1000
            out.append((ended_s - (o.started + offset + F2_DEADLINE_S)) * 1000)
    return out


def test_f2_short_deadlines_against_a_slow_worker(mesh):
    """Requests with 300 ms deadlines against a worker whose forward passes take 120 ms longer
    (the other worker stopped): each ends in a completion or DEADLINE_EXCEEDED within 50 ms of
    its deadline, and 1 s later no generation runs on for a client that is gone.

    The overshoot is what the client measured from its call to the error: the client's own gRPC
    deadline bounds it too, so the mesh's part is shown beside it (when the router wrote the
    error event), and a negative overshoot is the mesh's DEADLINE_EXCEEDED arriving first (a
    worker's attempt ends router.relay.WORKER_DEADLINE_MARGIN_NS early, so that every token it
    appended reaches the client, and the bill equals what the clients got)."""
    mesh.stop_one("worker0")
    saved = mesh.env
    mesh.stop_one("worker1")
    mesh.env = {**saved, STEP_DELAY_ENV: str(F2_STEP_DELAY_MS)}
    try:
        mesh.start_worker("worker1")
    finally:
        mesh.env = saved
    asyncio.run(mesh.wait_ready(["worker1"], 240))
    time.sleep(2.5)   # every router refreshed its registry since (worker0 gone, worker1 new)
    try:
        n = 40 * SCALE
        with gc_pauses() as pauses, client_stalls() as stalls:
            results = send(mesh, n, "f2", max_tokens=16, concurrency=20, timeout_s=F2_DEADLINE_S)
        ended = time.monotonic()
        overshoot_ms = sorted((o.seconds - F2_DEADLINE_S) * 1000 for o in results
                              if o.code == grpc.StatusCode.DEADLINE_EXCEEDED)
        time.sleep(max(0.0, ended + 1.0 - time.monotonic()))
        running = worker_load(mesh.procs["worker1"].address)
        server_ms = _server_overshoot_ms(mesh, results, "f2")
        p99 = _pct(overshoot_ms, 0.99)
        print(f"\n  F2: {len(overshoot_ms)} of {n} DEADLINE_EXCEEDED; overshoot past the "
              f"deadline p50 {_pct(overshoot_ms, 0.5):.1f} ms, "
              f"p99 {p99:.1f} ms, max {max(overshoot_ms, default=0):.1f} ms; 1 s after the last: "
              f"{running.num_running} running, {running.num_waiting} waiting on the worker; "
              f"{sum(o.num_tokens for o in results)} tokens reached "
              f"{sum(o.num_tokens > 0 for o in results)} clients before their deadline; the "
              f"router wrote the error event p50 {_pct(server_ms, 0.5):.0f} ms, p99 "
              f"{_pct(server_ms, 0.99):.0f} ms, max {max(server_ms, default=0):.0f} ms after "
              f"the deadline ({len(server_ms)} found); the client's own GC paused it "
              f"{pauses.count} times, longest {1e3 * pauses.longest_s:.1f} ms; its threads woke "
              f"late by up to {1e3 * stalls.longest_s:.1f} ms ({stalls.over_10ms} times over "
              f"10 ms; hypervisor steal {stalls.steal_s:.2f} s)")
        assert overshoot_ms, "no request hit its deadline: the worker is not slow enough"
        assert all(o.code in (None, grpc.StatusCode.DEADLINE_EXCEEDED) for o in results)
        assert running.num_running == 0 and running.num_waiting == 0
        # 50 ms past the deadline, plus the longest the client itself was held up while it
        # recorded (its clock reading is late by as much, whatever the mesh did); a mesh that
        # let a request run on for a whole step or more still fails the 500 ms bound.
        assert p99 <= 50 + 1e3 * stalls.longest_s, (overshoot_ms, stalls)
        assert p99 <= 500, overshoot_ms
        report("F2: 300 ms deadlines against a slow worker (tiny model, +120 ms a step)",
               results, mesh, "f2")
    finally:
        mesh.stop_one("worker1")
        mesh.start_worker("worker1")
        mesh.start_worker("worker0")
        asyncio.run(mesh.wait_ready(["worker0", "worker1"], 240))
