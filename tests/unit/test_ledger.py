"""UsageLedger: idempotent writes, time ranges, durability across reopen, a sound SQLite file."""
from __future__ import annotations

import asyncio
import dataclasses
import re
import sqlite3
import threading

import pytest

from costd import ledger as ledger_module
from costd.ledger import LedgerConfig, TenantUsage, UsageLedger
from costd.pipeline import PermanentError, RetryableError
from costd.usage import UsageRecord

S = 1_000_000_000


def record(request_id: str = "req-1", tenant_id: str = "acme", end_s: int = 100,
           **overrides) -> UsageRecord:
    fields = dict(request_id=request_id, tenant_id=tenant_id, model="smollm2-135m-instruct",
                  request_class="interactive", num_prompt_tokens=10,
                  num_cached_prompt_tokens=4, num_completion_tokens=7, prefill_device_s=0.25,
                  decode_device_s=0.5, device_type="cpu", worker_id="w0",
                  finish_reasons=("stop",), end_unix_ns=end_s * S)
    fields.update(overrides)
    return UsageRecord(**fields)


@pytest.fixture
def db_path(tmp_path) -> str:
    return str(tmp_path / "var" / "ledger.sqlite")


@pytest.fixture
def ledger(db_path):
    opened = UsageLedger(LedgerConfig(db_path)).open()
    yield opened
    opened.close()


def test_same_record_twice_is_counted_once(ledger):
    assert ledger.insert([record()]) == 1
    assert ledger.insert([record()]) == 0
    assert ledger.usage("acme") == TenantUsage("acme", 1, 10, 4, 7, 0.25, 0.5)


def test_repeat_inside_one_batch_is_counted_once(ledger):
    assert ledger.insert([record("a"), record("a"), record("b")]) == 2
    assert ledger.usage("acme").num_requests == 2


def test_first_write_wins_for_a_request_id(ledger):
    ledger.insert([record(num_completion_tokens=7)])
    # A retried export must never rewrite what was already billed.
    assert ledger.insert([record(num_completion_tokens=999)]) == 0
    assert ledger.usage("acme").num_completion_tokens == 7


def test_time_range_is_start_inclusive_end_exclusive_on_request_end(ledger):
    ledger.insert([record("r100", end_s=100), record("r200", end_s=200),
                   record("r300", end_s=300)])
    assert ledger.usage("acme", 200 * S, 300 * S).num_requests == 1
    assert ledger.usage("acme", 150 * S, 301 * S).num_requests == 2
    assert ledger.usage("acme", 301 * S).num_requests == 0
    assert ledger.usage("acme").num_requests == 3


def test_other_tenant_sees_zeros(ledger):
    ledger.insert([record(tenant_id="acme")])
    assert ledger.usage("globex") == TenantUsage("globex")


def test_survives_reopen(db_path, ledger):
    ledger.insert([record("a"), record("b", tenant_id="globex")])
    ledger.close()
    reopened = UsageLedger(LedgerConfig(db_path)).open()
    try:
        assert reopened.usage("acme") == TenantUsage("acme", 1, 10, 4, 7, 0.25, 0.5)
        assert reopened.insert([record("a")]) == 0
        assert reopened.usage("globex").num_requests == 1
    finally:
        reopened.close()


def test_file_is_sound_wal_and_versioned(db_path, ledger):
    ledger.insert([record(str(i)) for i in range(100)])
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("PRAGMA user_version").fetchone() == (ledger_module.SCHEMA_VERSION,)
        finish = conn.execute("SELECT finish_reasons FROM usage_records LIMIT 1").fetchone()
        assert finish == ('["stop"]',)
    finally:
        conn.close()


def test_schema_in_docstring_matches_the_one_created():
    def words(text: str) -> str:
        return re.sub(r"\s+", " ", text).strip()
    assert words(ledger_module._SCHEMA) in words(ledger_module.__doc__)


def test_newer_schema_is_refused(db_path):
    UsageLedger(LedgerConfig(db_path)).open().close()
    conn = sqlite3.connect(db_path)
    conn.execute(f"PRAGMA user_version={ledger_module.SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(PermanentError, match="newer"):
        UsageLedger(LedgerConfig(db_path)).open()


def test_closed_ledger_asks_sender_to_retry(db_path):
    closed = UsageLedger(LedgerConfig(db_path))
    with pytest.raises(RetryableError):
        closed.insert([record()])


def test_async_stage_writes_off_the_event_loop(db_path):
    threads: list[int] = []

    class SpyLedger(UsageLedger):
        def insert(self, records):
            threads.append(threading.get_ident())
            return super().insert(records)

    async def run() -> TenantUsage:
        spy = SpyLedger(LedgerConfig(db_path))
        await spy.start()
        try:
            assert await spy.consume([record()]) == ()
            return await spy.query_usage("acme")
        finally:
            await spy.shutdown()

    assert asyncio.run(run()).num_requests == 1
    assert threads and threads[0] != threading.get_ident()


@pytest.mark.parametrize("url, path", [
    ("sqlite:///var/ledger.sqlite", "var/ledger.sqlite"),
    ("sqlite:////tmp/ledger.sqlite", "/tmp/ledger.sqlite"),
    ("var/x.sqlite", "var/x.sqlite"),
])
def test_ledger_url(url, path):
    assert LedgerConfig.from_url(url).path == path


def test_unsupported_ledger_url():
    with pytest.raises(ValueError, match="postgresql"):
        LedgerConfig.from_url("postgresql://db/ledger")


def test_record_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        record().tenant_id = "globex"  # type: ignore[misc]
