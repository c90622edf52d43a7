"""Fault injection for the chaos suite (tests only; nothing happens without the variable).

LLMMESH_TEST_ROUTER_DIE_AT="<consumer>:<point>:<n>[,...]" SIGKILLs the router named <consumer>
the n-th time it reaches <point>, once per point: a marker file in LLMMESH_TEST_FAULT_DIR says
it happened, so the router started again in its place runs on. The points lie between a
request's final event and its bill reaching the ledger (tests/chaos/test_billing_points_chaos.py):

- "billed": the final and the billing record are written (one MULTI/EXEC); the budget is not
  settled and the queue entry not acknowledged;
- "before-ship": the shipper read a batch of billing records and has not exported it;
- "shipped": costd committed the batch; the shipper has not acknowledged it.
"""
from __future__ import annotations

import logging
import os
import signal
from collections import Counter

log = logging.getLogger("router.faults")
ENV, DIR_ENV = "LLMMESH_TEST_ROUTER_DIE_AT", "LLMMESH_TEST_FAULT_DIR"
_plan: dict[str, int] = {}
_seen: Counter = Counter()
_consumer = ""


def configure(consumer: str) -> None:
    global _consumer
    _consumer = consumer
    for spec in filter(None, os.environ.get(ENV, "").split(",")):
        who, point, n = spec.split(":")
        if who == consumer:
            _plan[point] = int(n)
    if _plan:
        log.warning("%s: this router SIGKILLs itself at %s (fault injection for tests)", ENV, _plan)


def reached(point: str) -> None:
    if point not in _plan:
        return
    _seen[point] += 1
    if _seen[point] < _plan[point]:
        return
    marker = os.path.join(os.environ.get(DIR_ENV, "."), f"died-{_consumer}-{point}")
    if os.path.exists(marker):
        return
    with open(marker, "w"):
        pass
    log.warning("fault injection: SIGKILL at %s (occurrence %d)", point, _seen[point])
    os.kill(os.getpid(), signal.SIGKILL)
