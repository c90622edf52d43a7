"""The usage ledger: the pipeline's exporter — one SQLite row per request, written exactly once.

Every write commits before `consume` returns, so an export that costd acknowledged survives a
costd crash; retried exports carry the same request ids and land as no-ops (ON CONFLICT DO
NOTHING). WAL lets billing readers run while the receiver writes. synchronous=NORMAL is the
trade: a commit survives a process crash but the last few may roll back on power loss or an OS
crash; set LedgerConfig.synchronous="FULL" where that matters more than write latency.

Schema, created on open (PRAGMA user_version holds the schema version, for later migrations):

    CREATE TABLE IF NOT EXISTS usage_records (
        request_id TEXT PRIMARY KEY,
        tenant_id TEXT NOT NULL,
        model TEXT NOT NULL,
        request_class TEXT NOT NULL,
        prompt_tokens INTEGER NOT NULL CHECK (prompt_tokens >= 0),
        cached_prompt_tokens INTEGER NOT NULL
            CHECK (cached_prompt_tokens BETWEEN 0 AND prompt_tokens),
        completion_tokens INTEGER NOT NULL CHECK (completion_tokens >= 0),
        prefill_device_s REAL NOT NULL CHECK (prefill_device_s >= 0),
        decode_device_s REAL NOT NULL CHECK (decode_device_s >= 0),
        device_type TEXT NOT NULL,
        worker_id TEXT NOT NULL,
        finish_reasons TEXT NOT NULL,
        end_unix_ns INTEGER NOT NULL,
        recorded_unix_ns INTEGER NOT NULL
    ) STRICT;
    CREATE INDEX IF NOT EXISTS usage_records_by_tenant_end
        ON usage_records (tenant_id, end_unix_ns);

request_id is the idempotency key; prompt_tokens includes cached_prompt_tokens (as
gen_ai.usage.input_tokens does); finish_reasons is a JSON array; end_unix_ns is the request's
end (its usage span's end) and is what time ranges filter on; recorded_unix_ns is when costd
first wrote the row, for audits.
"""
from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from costd.pipeline import PermanentError, Rejection, RetryableError
from costd.usage import UsageRecord

SCHEMA_VERSION = 1
# Kept word for word in the module docstring; tests/unit/test_ledger.py checks they agree.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_records (
    request_id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    model TEXT NOT NULL,
    request_class TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL CHECK (prompt_tokens >= 0),
    cached_prompt_tokens INTEGER NOT NULL
        CHECK (cached_prompt_tokens BETWEEN 0 AND prompt_tokens),
    completion_tokens INTEGER NOT NULL CHECK (completion_tokens >= 0),
    prefill_device_s REAL NOT NULL CHECK (prefill_device_s >= 0),
    decode_device_s REAL NOT NULL CHECK (decode_device_s >= 0),
    device_type TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    finish_reasons TEXT NOT NULL,
    end_unix_ns INTEGER NOT NULL,
    recorded_unix_ns INTEGER NOT NULL
) STRICT;
CREATE INDEX IF NOT EXISTS usage_records_by_tenant_end
    ON usage_records (tenant_id, end_unix_ns);
"""
_INSERT = """
INSERT INTO usage_records (
    request_id, tenant_id, model, request_class, prompt_tokens, cached_prompt_tokens,
    completion_tokens, prefill_device_s, decode_device_s, device_type, worker_id,
    finish_reasons, end_unix_ns, recorded_unix_ns)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (request_id) DO NOTHING
"""
_USAGE = """
SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_prompt_tokens), 0),
       COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(prefill_device_s), 0.0),
       COALESCE(SUM(decode_device_s), 0.0)
FROM usage_records
WHERE tenant_id = ? AND end_unix_ns >= ? AND end_unix_ns < ?
"""
_END_OF_TIME_NS = 2**63 - 1


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    path: str
    synchronous: str = "NORMAL"
    busy_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("ledger path is empty")
        if self.synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be NORMAL or FULL, got {self.synchronous!r}")
        if self.busy_timeout_s < 0:
            raise ValueError("busy_timeout_s must be >= 0")

    @classmethod
    def from_url(cls, url: str) -> LedgerConfig:
        """`sqlite:///relative/path`, `sqlite:////absolute/path`, or a bare file path."""
        if url.startswith("sqlite:///"):
            return cls(path=url[len("sqlite:///"):])
        if "://" in url:
            scheme = url.split("://", 1)[0]
            raise ValueError(f"ledger URL scheme {scheme!r} is not supported yet (use sqlite)")
        return cls(path=url)


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """A tenant's summed usage over a time range; all zeros when it has none."""

    tenant_id: str
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    prefill_device_s: float = 0.0
    decode_device_s: float = 0.0


def _row(record: UsageRecord, recorded_unix_ns: int) -> tuple:
    return (record.request_id, record.tenant_id, record.model, record.request_class,
            record.num_prompt_tokens, record.num_cached_prompt_tokens,
            record.num_completion_tokens, record.prefill_device_s, record.decode_device_s,
            record.device_type, record.worker_id, json.dumps(list(record.finish_reasons)),
            record.end_unix_ns, recorded_unix_ns)


def _classify(error: sqlite3.Error) -> Exception:
    # Busy, locked, disk full and I/O errors can clear up; anything else is data or a bug.
    if isinstance(error, sqlite3.OperationalError):
        return RetryableError(f"ledger unavailable: {error}")
    return PermanentError(f"ledger rejected the batch: {error}")


def _create_schema(conn: sqlite3.Connection) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            # Writing with an older schema would corrupt what the newer costd relies on.
            raise PermanentError(
                f"ledger schema v{version} is newer than this costd's v{SCHEMA_VERSION}")
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


class UsageLedger:
    """Owns the SQLite connection; sync methods for any thread, async ones for the event loop.

    One lock serialises every statement, so there is one writer at a time and no statement
    ever runs on the event loop (the async methods hop to a worker thread first).
    """

    def __init__(self, config: LedgerConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None

    def open(self) -> UsageLedger:
        with self._lock:
            if self._conn is None:
                self._conn = self._connect()
        return self

    def _connect(self) -> sqlite3.Connection:
        directory = os.path.dirname(self.config.path)
        if directory and self.config.path != ":memory:":
            os.makedirs(directory, exist_ok=True)
        # Autocommit mode: every transaction below is an explicit BEGIN … COMMIT.
        conn = sqlite3.connect(self.config.path, timeout=self.config.busy_timeout_s,
                               isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self.config.synchronous}")
        try:
            _create_schema(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def insert(self, records: Sequence[UsageRecord]) -> int:
        """Writes and commits the records; returns how many were new (the rest were repeats)."""
        now_ns = time.time_ns()
        rows = [_row(record, now_ns) for record in records]
        with self._lock:
            conn = self._require_open()
            try:
                conn.execute("BEGIN IMMEDIATE")
                before = conn.total_changes
                conn.executemany(_INSERT, rows)
                inserted = conn.total_changes - before
                conn.execute("COMMIT")
            except sqlite3.Error as error:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise _classify(error) from error
        return inserted

    def usage(self, tenant_id: str, start_unix_ns: int = 0,
              end_unix_ns: int | None = None) -> TenantUsage:
        """Usage of requests that ended in [start, end); end None means no upper bound."""
        end = _END_OF_TIME_NS if end_unix_ns is None else end_unix_ns
        with self._lock:
            conn = self._require_open()
            try:
                row = conn.execute(_USAGE, (tenant_id, start_unix_ns, end)).fetchone()
            except sqlite3.Error as error:
                raise _classify(error) from error
        return TenantUsage(tenant_id, *row)

    def _require_open(self) -> sqlite3.Connection:
        if self._conn is None:
            # Only reachable while costd stops; the sender keeps the batch and retries.
            raise RetryableError("ledger is closed")
        return self._conn

    # Pipeline stage (exporter) and async queries: same work, off the event loop.
    async def start(self) -> None:
        await asyncio.to_thread(self.open)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)

    async def consume(self, batch: Sequence[UsageRecord]) -> Sequence[Rejection]:
        await asyncio.to_thread(self.insert, batch)
        return ()

    async def query_usage(self, tenant_id: str, start_unix_ns: int = 0,
                          end_unix_ns: int | None = None) -> TenantUsage:
        return await asyncio.to_thread(self.usage, tenant_id, start_unix_ns, end_unix_ns)
