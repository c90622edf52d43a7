"""The shared ledger: PostgreSQL by URL, for a fleet where more than one costd writes.

Same tables and statements as SQLite (costd.ledger.store); a lost connection answers
UNAVAILABLE (the sender retries) and is reopened on the next call. Two costd starting at once
create the schema under an advisory lock, so neither sees half of it.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import psycopg

from costd.ledger.schema import POSTGRES_SCHEMA, SCHEMA_VERSION, statements
from costd.ledger.store import SqlStore
from costd.pipeline import PermanentError, RetryableError

# Any fixed number: it names the lock that serialises schema creation between costds.
_SCHEMA_LOCK_ID = 0x6C6C6D6D657368
_RETRYABLE = (psycopg.OperationalError, psycopg.errors.SerializationFailure,
              psycopg.errors.DeadlockDetected)


def classify(error: psycopg.Error) -> Exception:
    if isinstance(error, _RETRYABLE):
        return RetryableError(f"ledger unavailable: {error}")
    return PermanentError(f"ledger rejected the batch: {error}")


def _dialect(sql: str) -> str:
    return sql.replace("?", "%s")


def _create_schema(conn: psycopg.Connection) -> None:
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK_ID,))
        for statement in statements(POSTGRES_SCHEMA):
            conn.execute(statement)
        row = conn.execute("SELECT MAX(version) FROM ledger_schema").fetchone()
        version = row[0] if row and row[0] is not None else None
        if version is not None and version > SCHEMA_VERSION:
            raise PermanentError(
                f"ledger schema v{version} is newer than this costd's v{SCHEMA_VERSION}")
        if version is None:
            conn.execute("INSERT INTO ledger_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
        elif version < SCHEMA_VERSION:   # the script above has migrated it
            conn.execute("UPDATE ledger_schema SET version = %s", (SCHEMA_VERSION,))


class PostgresStore(SqlStore):
    def __init__(self, config) -> None:
        super().__init__(config)
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._writer: psycopg.Connection | None = None
        self._reader: psycopg.Connection | None = None
        self._open = False

    def _connect(self) -> psycopg.Connection:
        try:
            return psycopg.connect(self.config.path, autocommit=True,
                                   connect_timeout=max(1, round(self.config.busy_timeout_s)))
        except psycopg.Error as error:
            raise classify(error) from error

    def open(self) -> None:
        with self._write_lock, self._read_lock:
            if self._open:
                return
            writer = self._connect()
            try:
                _create_schema(writer)
            except psycopg.Error as error:
                writer.close()
                raise classify(error) from error
            except BaseException:
                writer.close()
                raise
            self._writer, self._open = writer, True

    def close(self) -> None:
        with self._write_lock, self._read_lock:
            for conn in (self._reader, self._writer):
                if conn is not None:
                    conn.close()
            self._writer = self._reader = None
            self._open = False

    def _live(self, conn: psycopg.Connection | None) -> psycopg.Connection:
        if not self._open:
            raise RetryableError("ledger is closed")
        return conn if conn is not None and not conn.closed else self._connect()

    @contextmanager
    def _writing(self) -> Iterator[Callable[[str, list[tuple]], int]]:
        with self._write_lock:
            self._writer = conn = self._live(self._writer)

            def executemany(sql: str, rows: list[tuple]) -> int:
                with conn.cursor() as cursor:
                    cursor.executemany(_dialect(sql), rows)
                    return max(cursor.rowcount, 0)

            try:
                with conn.transaction():
                    yield executemany
            except psycopg.Error as error:
                raise classify(error) from error

    def _read(self, sql: str, params: Sequence) -> list[tuple]:
        with self._read_lock:
            self._reader = conn = self._live(self._reader)
            try:
                return conn.execute(_dialect(sql), tuple(params)).fetchall()
            except psycopg.Error as error:
                raise classify(error) from error
