"""UsageLedger: idempotent writes, group commits, time ranges, reopen, schema; SQLite and PostgreSQL."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import sqlite3
import threading

import pytest

from costd.capacity import CapacityRecord
from costd.ledger import (HOUR_NS, SCHEMA_VERSION, CapacityAggregate, LedgerConfig, TenantUsage,
                          UsageLedger)
from costd.ledger import schema as schema_module
from costd.pipeline import PermanentError, RetryableError
from costd.usage import LedgerBatch, UsageRecord
from pg_ledger import postgres_url_or_skip  # tests/pg_ledger.py

S = 1_000_000_000
ACME_ONE = TenantUsage("acme", 1, 10, 4, 7, 250_000_000, 500_000_000)


def record(request_id: str = "req-1", tenant_id: str = "acme", end_s: int = 100,
           **overrides) -> UsageRecord:
    fields = dict(request_id=request_id, tenant_id=tenant_id, model="smollm2-135m-instruct",
                  request_class="interactive", num_prompt_tokens=10,
                  num_cached_prompt_tokens=4, num_completion_tokens=7, prefill_device_s=0.25,
                  decode_device_s=0.5, device_type="cpu", worker_id="w0",
                  finish_reasons=("stop",), end_unix_ns=end_s * S)
    fields.update(overrides)
    return UsageRecord(**fields)


def interval(worker: str, start_ns: int, end_ns: int, device: str = "cpu",
             loading_ns: int = 0) -> CapacityRecord:
    return CapacityRecord(f"{worker}:{start_ns}", worker, device, start_ns, end_ns, loading_ns)


@pytest.fixture
def db_path(tmp_path) -> str:
    return str(tmp_path / "var" / "ledger.sqlite")


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger_config(request, db_path):
    if request.param == "sqlite":
        yield LedgerConfig(db_path)
    else:
        yield from (LedgerConfig.from_url(url) for url in postgres_url_or_skip())


@pytest.fixture
def ledger(ledger_config):
    opened = UsageLedger(ledger_config).open()
    yield opened
    opened.close()


def test_same_record_twice_is_counted_once(ledger):
    assert ledger.insert([record()]) == 1
    assert ledger.insert([record()]) == 0
    assert ledger.usage("acme") == ACME_ONE


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


def test_capacity_intervals_are_idempotent_and_split_across_hours(ledger):
    h = HOUR_NS
    intervals = [interval("w0", 10 * h - 4 * S, 10 * h + 6 * S),  # straddles 10:00
                 interval("w0", 10 * h + 6 * S, 10 * h + 16 * S),
                 interval("w1", 10 * h + 6 * S, 10 * h + 16 * S, device="a100")]
    ledger.insert([], intervals)
    ledger.insert([], intervals[:2])  # a retried export
    assert ledger.store.capacity_by_hour(0, 20 * h) == [
        CapacityAggregate(9, "cpu", "w0", 4 * S), CapacityAggregate(10, "a100", "w1", 10 * S),
        CapacityAggregate(10, "cpu", "w0", 16 * S)]
    # The range clips intervals: only what lies inside it is capacity of that range.
    assert ledger.store.capacity_by_hour(10 * h, 10 * h + 8 * S) == [
        CapacityAggregate(10, "a100", "w1", 2 * S), CapacityAggregate(10, "cpu", "w0", 8 * S)]


def test_loading_time_is_kept_and_split_across_hours_exactly(ledger):
    h = HOUR_NS
    # 10 s straddling 10:00 (4 s before, 6 s after) with 5 s of loading: 2 s and 3 s.
    ledger.insert([], [interval("w0", 10 * h - 4 * S, 10 * h + 6 * S, loading_ns=5 * S),
                       interval("w0", 10 * h + 6 * S, 10 * h + 16 * S, loading_ns=S + 1),
                       interval("w1", 10 * h + 6 * S, 10 * h + 16 * S)])
    assert ledger.store.capacity_by_hour(0, 20 * h) == [
        CapacityAggregate(9, "cpu", "w0", 4 * S, 2 * S),
        CapacityAggregate(10, "cpu", "w0", 16 * S, 4 * S + 1),
        CapacityAggregate(10, "cpu", "w1", 10 * S, 0)]
    # 7 loading ns over four hour pieces (1 ns, 1 h, 1 h, 1 ns): they still sum to 7.
    ledger.insert([], [interval("w2", 20 * h - 1, 22 * h + 1, loading_ns=7)])
    pieces = [a for a in ledger.store.capacity_by_hour(0, 30 * h) if a.worker_id == "w2"]
    assert [a.device_ns for a in pieces] == [1, h, h, 1]
    assert sum(a.loading_ns for a in pieces) == 7


def test_usage_by_hour_sums_exact_nanoseconds(ledger):
    ledger.insert([record("a", end_s=3600 * 5 + 1, prefill_device_s=0.1),
                   record("b", end_s=3600 * 5 + 2, prefill_device_s=0.2),
                   record("c", end_s=3600 * 6, tenant_id="globex")])
    first, second = ledger.store.usage_by_hour(0, 7 * HOUR_NS)
    assert (first.hour, first.tenant_id, first.num_requests) == (5, "acme", 2)
    # 0.1 + 0.2 != 0.3 in floats; in integer ns it is exact.
    assert first.prefill_device_ns == 300_000_000
    assert (second.hour, second.tenant_id) == (6, "globex")


def test_usage_records_come_back_as_written(ledger):
    written = [record("a", end_s=5), record("b", end_s=6, tenant_id="globex")]
    ledger.insert(written)
    assert ledger.store.usage_records(0, 10 * S) == written
    assert ledger.store.usage_records(0, 10 * S, "globex") == written[1:]


def test_survives_reopen(ledger_config, ledger):
    ledger.insert([record("a"), record("b", tenant_id="globex")])
    ledger.close()
    reopened = UsageLedger(ledger_config).open()
    try:
        assert reopened.usage("acme") == ACME_ONE
        assert reopened.insert([record("a")]) == 0
        assert reopened.usage("globex").num_requests == 1
    finally:
        reopened.close()


def test_closed_ledger_asks_sender_to_retry(ledger_config):
    closed = UsageLedger(ledger_config)
    with pytest.raises(RetryableError):
        closed.insert([record()])


def test_concurrent_exports_share_commits_and_all_land(ledger_config):
    async def run(ledger: UsageLedger) -> None:
        await ledger.start()
        try:
            batches = [LedgerBatch((record(f"r{i}"),)) for i in range(50)]
            await asyncio.gather(*(ledger.consume(b) for b in batches))
            assert ledger.num_commits < 50  # grouped: exports queued behind a commit share the next
            assert (await ledger.query_usage("acme")).num_requests == 50
        finally:
            await ledger.shutdown()

    asyncio.run(run(UsageLedger(ledger_config)))


def test_a_failing_batch_fails_alone_in_its_group(db_path):
    ledger = UsageLedger(LedgerConfig(db_path))
    real_write = ledger.store.write

    def write(batches):
        if any(r.request_id == "poison" for b in batches for r in b.usage):
            raise PermanentError("poison")
        return real_write(batches)

    ledger.store.write = write  # type: ignore[method-assign]

    async def run() -> list:
        await ledger.start()
        try:
            batches = [LedgerBatch((record(name),)) for name in ("a", "poison", "b")]
            return await asyncio.gather(*(ledger.consume(b) for b in batches),
                                        return_exceptions=True)
        finally:
            await ledger.shutdown()

    outcomes = asyncio.run(run())
    assert [type(o).__name__ for o in outcomes] == ["tuple", "PermanentError", "tuple"]
    assert ledger.open().usage("acme").num_requests == 2


def test_consume_after_shutdown_is_retryable(db_path):
    async def run() -> None:
        ledger = UsageLedger(LedgerConfig(db_path))
        await ledger.start()
        await ledger.shutdown()
        with pytest.raises(RetryableError):
            await ledger.consume(LedgerBatch((record(),)))

    asyncio.run(run())


def test_writes_run_off_the_event_loop(db_path):
    threads: list[int] = []
    ledger = UsageLedger(LedgerConfig(db_path))
    real_write = ledger.store.write
    ledger.store.write = lambda b: threads.append(threading.get_ident()) or real_write(b)

    async def run() -> TenantUsage:
        await ledger.start()
        try:
            assert await ledger.consume(LedgerBatch((record(),))) == ()
            return await ledger.query_usage("acme")
        finally:
            await ledger.shutdown()

    assert asyncio.run(run()).num_requests == 1
    assert threads and threads[0] != threading.get_ident()


def test_sqlite_file_is_sound_wal_and_versioned(db_path):
    ledger = UsageLedger(LedgerConfig(db_path)).open()
    ledger.insert([record(str(i)) for i in range(100)])
    ledger.close()
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
        finish = conn.execute("SELECT finish_reasons FROM usage_records LIMIT 1").fetchone()
        assert finish == ('["stop"]',)
    finally:
        conn.close()


def test_schema_in_docstring_matches_the_one_created():
    def words(text: str) -> str:
        return re.sub(r"\s+", " ", text).strip()
    assert words(schema_module.SQLITE_SCHEMA) in words(schema_module.__doc__)


# The walking skeleton's schema, word for word: ledgers it wrote must open and bill.
V1_SCHEMA = """
CREATE TABLE usage_records (
    request_id TEXT PRIMARY KEY, tenant_id TEXT NOT NULL, model TEXT NOT NULL,
    request_class TEXT NOT NULL, prompt_tokens INTEGER NOT NULL CHECK (prompt_tokens >= 0),
    cached_prompt_tokens INTEGER NOT NULL CHECK (cached_prompt_tokens BETWEEN 0 AND prompt_tokens),
    completion_tokens INTEGER NOT NULL CHECK (completion_tokens >= 0),
    prefill_device_s REAL NOT NULL CHECK (prefill_device_s >= 0),
    decode_device_s REAL NOT NULL CHECK (decode_device_s >= 0),
    device_type TEXT NOT NULL, worker_id TEXT NOT NULL, finish_reasons TEXT NOT NULL,
    end_unix_ns INTEGER NOT NULL, recorded_unix_ns INTEGER NOT NULL) STRICT;
INSERT INTO usage_records VALUES ('old', 'acme', 'm', 'batch', 10, 4, 7, 0.25, 0.5, 'cpu', 'w0',
                                  '["stop"]', 100000000000, 1);
PRAGMA user_version=1;
"""


def _open_old_ledger(db_path: str, script: str) -> UsageLedger:
    """A ledger file an older costd wrote (its schema `script`), opened by this one."""
    os.makedirs(os.path.dirname(db_path), exist_ok=True)
    conn = sqlite3.connect(db_path)
    conn.executescript(script)
    conn.close()
    return UsageLedger(LedgerConfig(db_path)).open()


def test_v1_ledger_is_migrated_in_place(db_path):
    ledger = _open_old_ledger(db_path, V1_SCHEMA)
    try:
        assert ledger.usage("acme") == TenantUsage("acme", 1, 10, 4, 7, 250_000_000, 500_000_000)
        ledger.insert([], [interval("w0", S, 2 * S)])  # the new table exists
    finally:
        ledger.close()


# v2's capacity table, word for word: ledgers it wrote gain loading_ns (0) in place.
V2_CAPACITY = """
CREATE TABLE capacity_intervals (
    interval_id TEXT PRIMARY KEY, worker_id TEXT NOT NULL, device_type TEXT NOT NULL,
    start_unix_ns INTEGER NOT NULL,
    end_unix_ns INTEGER NOT NULL CHECK (end_unix_ns >= start_unix_ns),
    recorded_unix_ns INTEGER NOT NULL) STRICT;
INSERT INTO capacity_intervals VALUES ('w0:1', 'w0', 'cpu', 1000000000, 3000000000, 1);
PRAGMA user_version=2;
"""


def test_v2_ledger_gains_loading_time_in_place(db_path):
    ledger = _open_old_ledger(db_path, V2_CAPACITY)
    try:
        ledger.insert([], [interval("w0", 3 * S, 5 * S, loading_ns=S)])
        assert ledger.store.capacity_by_hour(0, HOUR_NS) == [
            CapacityAggregate(0, "cpu", "w0", 4 * S, S)]
    finally:
        ledger.close()
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,) == (3,)
    finally:
        conn.close()


def test_v2_postgres_ledger_gains_loading_time_in_place():
    psycopg = pytest.importorskip("psycopg")
    for url in postgres_url_or_skip():
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE ledger_schema (version INTEGER NOT NULL)")
            conn.execute("INSERT INTO ledger_schema VALUES (2)")
            conn.execute("""CREATE TABLE capacity_intervals (
                interval_id TEXT PRIMARY KEY, worker_id TEXT NOT NULL,
                device_type TEXT NOT NULL, start_unix_ns BIGINT NOT NULL,
                end_unix_ns BIGINT NOT NULL CHECK (end_unix_ns >= start_unix_ns),
                recorded_unix_ns BIGINT NOT NULL)""")
            conn.execute("INSERT INTO capacity_intervals VALUES ('w0:1', 'w0', 'cpu', "
                         "1000000000, 3000000000, 1)")
        ledger = UsageLedger(LedgerConfig.from_url(url)).open()
        try:
            ledger.insert([], [interval("w0", 3 * S, 5 * S, loading_ns=S)])
            assert ledger.store.capacity_by_hour(0, HOUR_NS) == [
                CapacityAggregate(0, "cpu", "w0", 4 * S, S)]
        finally:
            ledger.close()
        with psycopg.connect(url, autocommit=True) as conn:
            assert conn.execute("SELECT version FROM ledger_schema").fetchall() == [(3,)]


def test_newer_schema_is_refused(db_path):
    UsageLedger(LedgerConfig(db_path)).open().close()
    conn = sqlite3.connect(db_path)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(PermanentError, match="newer"):
        UsageLedger(LedgerConfig(db_path)).open()


@pytest.mark.parametrize("url, backend, path", [
    ("sqlite:///var/ledger.sqlite", "sqlite", "var/ledger.sqlite"),
    ("sqlite:////tmp/ledger.sqlite", "sqlite", "/tmp/ledger.sqlite"),
    ("var/x.sqlite", "sqlite", "var/x.sqlite"),
    ("postgresql://root@db:5432/ledger", "postgresql", "postgresql://root@db:5432/ledger"),
])
def test_ledger_url(url, backend, path):
    config = LedgerConfig.from_url(url)
    assert (config.backend, config.path) == (backend, path)


def test_unsupported_ledger_url():
    with pytest.raises(ValueError, match="mysql"):
        LedgerConfig.from_url("mysql://db/ledger")


def test_postgres_password_never_shows():
    assert LedgerConfig.from_url("postgresql://u:secret@db/l").display == "postgresql://u@db/l"


def test_record_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        record().tenant_id = "globex"  # type: ignore[misc]
