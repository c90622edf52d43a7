"""The ledger's schema, one text per dialect, and its migrations (v1 → v2 → v3).

SQLite (PRAGMA user_version holds the version) — PostgreSQL has the same tables with BIGINT /
DOUBLE PRECISION columns and keeps its version in `ledger_schema`:

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
        recorded_unix_ns INTEGER NOT NULL,
        prefill_device_ns INTEGER NOT NULL DEFAULT 0 CHECK (prefill_device_ns >= 0),
        decode_device_ns INTEGER NOT NULL DEFAULT 0 CHECK (decode_device_ns >= 0)
    ) STRICT;
    CREATE INDEX IF NOT EXISTS usage_records_by_tenant_end
        ON usage_records (tenant_id, end_unix_ns);
    CREATE INDEX IF NOT EXISTS usage_records_by_end ON usage_records (end_unix_ns);
    CREATE TABLE IF NOT EXISTS capacity_intervals (
        interval_id TEXT PRIMARY KEY,
        worker_id TEXT NOT NULL,
        device_type TEXT NOT NULL,
        start_unix_ns INTEGER NOT NULL,
        end_unix_ns INTEGER NOT NULL CHECK (end_unix_ns >= start_unix_ns),
        recorded_unix_ns INTEGER NOT NULL,
        loading_ns INTEGER NOT NULL DEFAULT 0 CHECK (loading_ns >= 0)
    ) STRICT;
    CREATE INDEX IF NOT EXISTS capacity_intervals_by_start
        ON capacity_intervals (start_unix_ns);

usage_records: one row per request; request_id is the idempotency key (first write wins);
prompt_tokens includes cached_prompt_tokens (as gen_ai.usage.input_tokens does);
finish_reasons is a JSON array; end_unix_ns is the request's end (its usage span's end), what
time ranges and charge periods use; recorded_unix_ns is when costd first wrote the row, for
audits. *_device_s are the seconds as sent; *_device_ns are the same rounded to integer
nanoseconds, which is what billing sums, so sums are exact in SQL on either database.
capacity_intervals: one row per worker capacity report (costd.capacity); interval_id is the
idempotency key; a worker's intervals are contiguous, so their sum is its uptime;
loading_ns is the part of the interval the worker spent loading models (v3; 0 before).
"""
from __future__ import annotations

SCHEMA_VERSION = 3
# Kept word for word in the module docstring; tests/unit/test_ledger.py checks they agree.
SQLITE_SCHEMA = """
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
    recorded_unix_ns INTEGER NOT NULL,
    prefill_device_ns INTEGER NOT NULL DEFAULT 0 CHECK (prefill_device_ns >= 0),
    decode_device_ns INTEGER NOT NULL DEFAULT 0 CHECK (decode_device_ns >= 0)
) STRICT;
CREATE INDEX IF NOT EXISTS usage_records_by_tenant_end
    ON usage_records (tenant_id, end_unix_ns);
CREATE INDEX IF NOT EXISTS usage_records_by_end ON usage_records (end_unix_ns);
CREATE TABLE IF NOT EXISTS capacity_intervals (
    interval_id TEXT PRIMARY KEY,
    worker_id TEXT NOT NULL,
    device_type TEXT NOT NULL,
    start_unix_ns INTEGER NOT NULL,
    end_unix_ns INTEGER NOT NULL CHECK (end_unix_ns >= start_unix_ns),
    recorded_unix_ns INTEGER NOT NULL,
    loading_ns INTEGER NOT NULL DEFAULT 0 CHECK (loading_ns >= 0)
) STRICT;
CREATE INDEX IF NOT EXISTS capacity_intervals_by_start
    ON capacity_intervals (start_unix_ns);
"""

# v1 (the walking skeleton) had usage_records without the *_device_ns columns and no
# capacity table; its seconds convert to nanoseconds the same way new rows do.
SQLITE_MIGRATE_V1 = """
ALTER TABLE usage_records ADD COLUMN
    prefill_device_ns INTEGER NOT NULL DEFAULT 0 CHECK (prefill_device_ns >= 0);
ALTER TABLE usage_records ADD COLUMN
    decode_device_ns INTEGER NOT NULL DEFAULT 0 CHECK (decode_device_ns >= 0);
UPDATE usage_records SET prefill_device_ns = CAST(round(prefill_device_s * 1e9) AS INTEGER),
                         decode_device_ns = CAST(round(decode_device_s * 1e9) AS INTEGER);
"""

# v2 had capacity intervals without loading time: none was recorded, so 0 is exact.
SQLITE_MIGRATE_V2 = """
ALTER TABLE capacity_intervals ADD COLUMN
    loading_ns INTEGER NOT NULL DEFAULT 0 CHECK (loading_ns >= 0);
"""

# PostgreSQL's script is idempotent and migrates by itself (ADD COLUMN IF NOT EXISTS).
POSTGRES_SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger_schema (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS usage_records (
    request_id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    model TEXT NOT NULL,
    request_class TEXT NOT NULL,
    prompt_tokens BIGINT NOT NULL CHECK (prompt_tokens >= 0),
    cached_prompt_tokens BIGINT NOT NULL
        CHECK (cached_prompt_tokens BETWEEN 0 AND prompt_tokens),
    completion_tokens BIGINT NOT NULL CHECK (completion_tokens >= 0),
    prefill_device_s DOUBLE PRECISION NOT NULL CHECK (prefill_device_s >= 0),
    decode_device_s DOUBLE PRECISION NOT NULL CHECK (decode_device_s >= 0),
    device_type TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    finish_reasons TEXT NOT NULL,
    end_unix_ns BIGINT NOT NULL,
    recorded_unix_ns BIGINT NOT NULL,
    prefill_device_ns BIGINT NOT NULL DEFAULT 0 CHECK (prefill_device_ns >= 0),
    decode_device_ns BIGINT NOT NULL DEFAULT 0 CHECK (decode_device_ns >= 0)
);
CREATE INDEX IF NOT EXISTS usage_records_by_tenant_end
    ON usage_records (tenant_id, end_unix_ns);
CREATE INDEX IF NOT EXISTS usage_records_by_end ON usage_records (end_unix_ns);
CREATE TABLE IF NOT EXISTS capacity_intervals (
    interval_id TEXT PRIMARY KEY,
    worker_id TEXT NOT NULL,
    device_type TEXT NOT NULL,
    start_unix_ns BIGINT NOT NULL,
    end_unix_ns BIGINT NOT NULL CHECK (end_unix_ns >= start_unix_ns),
    recorded_unix_ns BIGINT NOT NULL,
    loading_ns BIGINT NOT NULL DEFAULT 0 CHECK (loading_ns >= 0)
);
CREATE INDEX IF NOT EXISTS capacity_intervals_by_start
    ON capacity_intervals (start_unix_ns);
ALTER TABLE capacity_intervals ADD COLUMN IF NOT EXISTS
    loading_ns BIGINT NOT NULL DEFAULT 0 CHECK (loading_ns >= 0);
"""


def statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]
