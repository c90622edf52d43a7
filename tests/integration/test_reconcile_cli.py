"""`llmmesh reconcile` as an operator runs it: a real redis-server, a SQLite ledger file, the CLI
and its `python -m costd.reconcile` subprocess."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import redis.asyncio as aioredis

from costd.ledger import LedgerConfig, UsageLedger
from llmmesh import billing
from llmmesh.admission import Admission, Reservation


async def _unshipped_bill(url: str) -> None:
    redis = aioredis.Redis.from_url(url, decode_responses=True)
    attributes = billing.record_attributes(
        request_id="cli-1", tenant_id="acme", model="m", request_class="batch",
        usage={"prompt_tokens": 5, "cached_prompt_tokens": 0, "completion_tokens": 3,
               "prefill_device_s": 0.0, "decode_device_s": 0.0}, finish_reason="length",
        device_type="cpu", worker_ids=["w0"])
    now = time.time_ns()
    await redis.xadd(billing.BILLING_STREAM, billing.encode_record(
        attributes, start_unix_ns=now, end_unix_ns=now))
    await Admission(redis).settle(Reservation("acme", "cli-1", 8, ""), 8, "cli-1")
    await redis.aclose()


def _reconcile(db: str, url: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmmesh.cli", "reconcile", "--since", "1h",
                           "--grace", "0s", "--db", db, "--redis-url", url, *flags],
                          capture_output=True, text=True, timeout=60)


def test_reconcile_reports_repairs_and_then_exits_zero(redis_server, tmp_path):
    db = str(tmp_path / "ledger.sqlite")
    UsageLedger(LedgerConfig(path=db)).open().close()
    asyncio.run(_unshipped_bill(redis_server.url))

    found = _reconcile(db, redis_server.url, "--json")
    assert found.returncode == 1, found.stderr
    (gap,) = json.loads(found.stdout)["gaps"]
    assert (gap["kind"], gap["tenant_id"], gap["redis_tokens"]) == ("unbilled", "acme", 8)

    repaired = _reconcile(db, redis_server.url, "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "repaired 1, open gaps 0" in repaired.stdout and "cli-1" in repaired.stdout
    assert _reconcile(db, redis_server.url).returncode == 0
    ledger = UsageLedger(LedgerConfig(path=db)).open()
    try:
        usage = ledger.usage("acme")
    finally:
        ledger.close()
    assert (usage.num_requests, usage.num_prompt_tokens, usage.num_completion_tokens) == (1, 5, 3)


def test_reconcile_without_a_ledger_fails_rather_than_report_every_bill_missing(redis_server,
                                                                              tmp_path):
    done = _reconcile(str(tmp_path / "absent.sqlite"), redis_server.url)
    assert done.returncode == 2 and "no ledger at" in done.stderr
    assert not (tmp_path / "absent.sqlite").exists()
