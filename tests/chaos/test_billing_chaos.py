"""Bills survive the processes that carry them (the short version `make test` runs; `make chaos`
runs the same scenarios longer): costd down while requests complete, and a router SIGKILLed with
requests in flight. Each prints sent / completed / errors / lost / double-billed / unbilled
tokens, computed from client records against the ledger, and asserts the last three are 0."""
from __future__ import annotations

import asyncio
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from llmmesh import queue
from tests.chaos.chaoskit import SCALE, chaos_mesh, report, send
from tests.e2e.meshkit import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.model]


@pytest.fixture
def mesh(tmp_path):
    with chaos_mesh(tmp_path, workers=1) as m:
        yield m


def test_costd_down_while_requests_complete_bills_arrive_after(mesh):
    """costd down for 60 s under load in `make chaos` (6 s in `make test`): requests complete
    meanwhile (billing is off their path) and every bill arrives once costd is back."""
    address = mesh.procs["costd"].address
    outage_s = 60.0 if SCALE >= 5 else 6.0
    mesh.stop_one("costd")
    down_at = time.monotonic()
    results = send(mesh, 12 * SCALE, "costd", interval_s=outage_s / (12 * SCALE * 2))
    assert all(o.usage is not None for o in results)
    time.sleep(max(0.0, outage_s - (time.monotonic() - down_at)))   # the shippers retry meanwhile
    mesh.start_service("costd", "costd", address=address)
    asyncio.run(mesh.wait_ready(["costd"], 30))
    report(f"costd down {outage_s:.0f} s under load, then back", results, mesh, "costd")


def test_a_router_killed_with_requests_in_flight_loses_and_doubles_no_bill(mesh):
    with ThreadPoolExecutor(1) as pool:
        sending = pool.submit(send, mesh, 16 * SCALE, "router")
        r = redis.Redis.from_url(mesh.redis_url, decode_responses=True)

        def router_holds_entries():
            return any(c["name"] == "router" and int(c["pending"]) > 0
                       for cls in queue.CLASSES
                       for c in r.xpending(queue.queue_stream(cls), queue.ROUTER_GROUP)["consumers"])
        wait_until(router_holds_entries, 30, interval_s=0.01, what="the router to hold entries")
        mesh.stop_one("router", signal.SIGKILL)   # its pending entries and bills: taken over
        results = sending.result(timeout=180)
    assert all(o.usage is not None for o in results), results
    report("a router SIGKILLed mid-load", results, mesh, "router")
    assert "took over" in open(f"{mesh.log_dir}/router1.log").read()
