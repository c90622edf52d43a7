"""The usage ledger: the pipeline's exporter, committing concurrent exports in groups.

`consume` returns only after the batch's transaction committed, so an export costd
acknowledged is on disk. One task owns the write queue: whatever exports arrived while the
previous commit ran are written together in the next transaction (a group commit), so under
load there is one fsync per group rather than per export, and at rest no export waits.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from costd.capacity import CapacityRecord
from costd.ledger.config import POSTGRESQL, LedgerConfig
from costd.ledger.store import END_OF_TIME_NS, SqlStore, TenantUsage
from costd.pipeline import PipelineError, Rejection, RetryableError
from costd.usage import LedgerBatch, UsageRecord

log = logging.getLogger(__name__)
_STOP = object()


def open_store(config: LedgerConfig) -> SqlStore:
    if config.backend == POSTGRESQL:
        from costd.ledger.postgres_store import PostgresStore  # psycopg only when asked for
        return PostgresStore(config)
    from costd.ledger.sqlite_store import SqliteStore
    return SqliteStore(config)


def _size(batch: LedgerBatch) -> int:
    return len(batch.usage) + len(batch.capacity)


class UsageLedger:
    """Owns the store; sync methods for tools and tests, async ones for the event loop."""

    def __init__(self, config: LedgerConfig, store: SqlStore | None = None) -> None:
        self.config = config
        self.store = store or open_store(config)
        self._queue: asyncio.Queue | None = None
        self._committer: asyncio.Task | None = None
        self.num_commits = 0  # transactions written by the committer, for tests and logs
        self.metrics = None   # costd.metrics.CostdMetrics, or None

    # Synchronous API (any thread).
    def open(self) -> UsageLedger:
        self.store.open()
        return self

    def close(self) -> None:
        self.store.close()

    def insert(self, records: Sequence[UsageRecord],
               capacity: Sequence[CapacityRecord] = ()) -> int:
        """Writes and commits; returns how many usage records were new (repeats are no-ops)."""
        return self.store.write([LedgerBatch(tuple(records), tuple(capacity))]).num_new_usage

    def usage(self, tenant_id: str, start_unix_ns: int = 0,
              end_unix_ns: int | None = None) -> TenantUsage:
        """Usage of requests that ended in [start, end); end None means no upper bound."""
        end = END_OF_TIME_NS if end_unix_ns is None else end_unix_ns
        return self.store.tenant_usage(tenant_id, start_unix_ns, end)

    # Pipeline stage (exporter).
    async def start(self) -> None:
        await asyncio.to_thread(self.open)
        self._queue = asyncio.Queue()
        self._committer = asyncio.create_task(self._commit_loop(self._queue),
                                              name="ledger-committer")

    async def shutdown(self) -> None:
        if self._committer is not None:
            queue, self._queue = self._queue, None  # new exports now get UNAVAILABLE
            queue.put_nowait((_STOP, None))
            await self._committer  # drains what was queued before the stop
            self._committer = None
        await asyncio.to_thread(self.close)

    async def consume(self, batch: LedgerBatch) -> Sequence[Rejection]:
        if self._queue is None:
            raise RetryableError("ledger is closed")
        done = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((batch, done))
        await done
        return ()

    async def _commit_loop(self, queue: asyncio.Queue) -> None:
        stopping = False
        while not stopping:
            group = [await queue.get()]
            num_records = _size(group[0][0]) if group[0][0] is not _STOP else 0
            while num_records < self.config.max_group_records and not queue.empty():
                group.append(queue.get_nowait())
                if group[-1][0] is not _STOP:
                    num_records += _size(group[-1][0])
            stopping = any(batch is _STOP for batch, _ in group)
            pending = [(batch, done) for batch, done in group if batch is not _STOP]
            if pending:
                await self._commit(pending)

    async def _commit(self, group: list[tuple[LedgerBatch, asyncio.Future]]) -> None:
        try:
            batches = [batch for batch, _ in group]
            result = await asyncio.to_thread(self._write, batches)
            self.num_commits += 1
            if self.metrics is not None:
                self.metrics.committed(batches, result)
            outcomes: list[BaseException | None] = [None] * len(group)
        except PipelineError as error:
            if len(group) == 1:
                outcomes = [error]
            else:
                # One bad batch must not fail its neighbours: retry each on its own.
                outcomes = [await self._commit_alone(batch) for batch, _ in group]
        except Exception as error:  # noqa: BLE001 - a bug still answers every waiting export
            log.exception("ledger commit failed")
            outcomes = [error] * len(group)
        for (_, done), outcome in zip(group, outcomes):
            if done.done():
                continue  # the export's caller went away; its batch committed regardless
            if outcome is None:
                done.set_result(None)
            else:
                done.set_exception(outcome)

    async def _commit_alone(self, batch: LedgerBatch) -> BaseException | None:
        try:
            result = await asyncio.to_thread(self._write, [batch])
            self.num_commits += 1
            if self.metrics is not None:
                self.metrics.committed([batch], result)
        except PipelineError as error:
            return error
        return None

    def _write(self, batches: list[LedgerBatch]):
        # Which records are repeats costs a read per commit: only the money metric asks.
        if self.metrics is not None and self.metrics.book is not None:
            return self.store.write(batches, find_known=True)
        return self.store.write(batches)

    # Async queries: same work, off the event loop.
    async def query(self, method: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(method, *args)

    async def query_usage(self, tenant_id: str, start_unix_ns: int = 0,
                          end_unix_ns: int | None = None) -> TenantUsage:
        return await asyncio.to_thread(self.usage, tenant_id, start_unix_ns, end_unix_ns)
