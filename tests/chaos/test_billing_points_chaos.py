"""B2: a router SIGKILLed at each point between a request's final event and its bill in the
ledger (router/faults.py: after the final + billing record's MULTI/EXEC, before the shipper's
export, after costd committed the export but before the shipper acknowledged it), under load
from two tenants, with a second router taking its entries and its unshipped bills over: the
ledger equals the client records exactly, nothing lost, nothing billed twice."""
from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from router import faults
from tests.chaos.chaoskit import ROUTER_ARGS, SCALE, chaos_mesh, report, send
from tests.e2e.meshkit import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.model]
POINTS = ("billed", "before-ship", "shipped")


@pytest.fixture
def mesh(tmp_path):
    # The router named "router" dies at each point once (the 2nd time it gets there).
    env = {faults.ENV: ",".join(f"router:{p}:2" for p in POINTS), faults.DIR_ENV: str(tmp_path)}
    with chaos_mesh(tmp_path, workers=1, env=env) as m:
        yield m


def test_b2_a_router_killed_at_each_point_between_final_and_ledger(mesh):
    died = lambda: {p for p in POINTS if os.path.exists(os.path.join(mesh.var_dir, f"died-router-{p}"))}  # noqa: E731
    outcomes, rounds = [], 0
    with ThreadPoolExecutor(1) as pool:
        while died() != set(POINTS) and rounds < 2 * len(POINTS):
            rounds += 1
            sending = pool.submit(send, mesh, 8 * SCALE, f"b2r{rounds}")
            try:
                wait_until(lambda: not mesh.procs["router"].alive(), 60, interval_s=0.02,
                           what="the router to reach its next fault point")
            except AssertionError:
                pass   # this round's requests went to the other router: send more
            outcomes_round = sending.result(timeout=240)
            at = sorted(died() - {p for _, _, ps in outcomes for p in ps})
            outcomes += [(f"b2r{rounds}", o, tuple(at)) for o in outcomes_round]
            if not mesh.procs["router"].alive():   # back in its place (its next point armed)
                mesh.start_service("router", "router", ["--consumer", "router", *ROUTER_ARGS])
                asyncio.run(mesh.wait_ready(["router"], 60))
    print(f"\n  router SIGKILLed at {sorted(died())} in {rounds} rounds")
    assert died() == set(POINTS)
    assert all(o.usage is not None for _, o, _ in outcomes), [o for _, o, _ in outcomes if o.usage is None]
    for tag, points in sorted({(t, ps) for t, _, ps in outcomes}):
        report(f"B2 router SIGKILLed at {', '.join(points) or 'no point'} (round {tag[3:]})",
               [o for t, o, _ in outcomes if t == tag], mesh, tag)
    log = open(f"{mesh.log_dir}/router.log").read()
    assert log.count("fault injection: SIGKILL at") == len(POINTS)
