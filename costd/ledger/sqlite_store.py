"""The embedded ledger: one SQLite file in WAL mode.

Every write commits before the export is acknowledged, so an acknowledged export survives a
costd crash. synchronous=NORMAL is the trade: a commit survives a process crash but the last
few may roll back on power loss or an OS crash; use synchronous="FULL" where that matters
more than write latency. Writes and reads have a connection each, so a long billing query
never holds up ingestion (WAL lets the reader see the last commit while the writer writes).
"""
from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from costd.ledger.schema import (SCHEMA_VERSION, SQLITE_MIGRATE_V1, SQLITE_MIGRATE_V2,
                                 SQLITE_SCHEMA, statements)
from costd.ledger.store import SqlStore
from costd.pipeline import PermanentError, RetryableError


def classify(error: sqlite3.Error) -> Exception:
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
        if version == 1:   # v1 had no capacity table: the schema below creates it as v3
            for statement in statements(SQLITE_MIGRATE_V1):
                conn.execute(statement)
        if version == 2:
            for statement in statements(SQLITE_MIGRATE_V2):
                conn.execute(statement)
        for statement in statements(SQLITE_SCHEMA):
            conn.execute(statement)
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


class SqliteStore(SqlStore):
    def __init__(self, config) -> None:
        super().__init__(config)
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._writer: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None

    def _connect(self) -> sqlite3.Connection:
        # Autocommit mode: every transaction below is an explicit BEGIN … COMMIT.
        conn = sqlite3.connect(self.config.path, timeout=self.config.busy_timeout_s,
                               isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self.config.synchronous}")
        return conn

    def open(self) -> None:
        with self._write_lock, self._read_lock:
            if self._writer is not None:
                return
            directory = os.path.dirname(self.config.path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            writer = self._connect()
            try:
                _create_schema(writer)
                self._reader = self._connect()
            except BaseException:
                writer.close()
                raise
            self._writer = writer

    def close(self) -> None:
        with self._write_lock, self._read_lock:
            for conn in (self._reader, self._writer):
                if conn is not None:
                    conn.close()
            self._writer = self._reader = None

    @contextmanager
    def _writing(self) -> Iterator[Callable[[str, list[tuple]], int]]:
        with self._write_lock:
            conn = self._require(self._writer)

            def executemany(sql: str, rows: list[tuple]) -> int:
                before = conn.total_changes
                conn.executemany(sql, rows)
                return conn.total_changes - before

            try:
                conn.execute("BEGIN IMMEDIATE")
                yield executemany
                conn.execute("COMMIT")
            except sqlite3.Error as error:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise classify(error) from error
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def _read(self, sql: str, params: Sequence) -> list[tuple]:
        with self._read_lock:
            conn = self._require(self._reader)
            try:
                return conn.execute(sql, tuple(params)).fetchall()
            except sqlite3.Error as error:
                raise classify(error) from error

    @staticmethod
    def _require(conn: sqlite3.Connection | None) -> sqlite3.Connection:
        if conn is None:
            # Only reachable while costd stops; the sender keeps the batch and retries.
            raise RetryableError("ledger is closed")
        return conn
