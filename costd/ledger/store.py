"""The SQL both ledger databases share: idempotent writes and the aggregates billing reads.

A store is synchronous and thread-safe (its connections are serialised by locks); the
`UsageLedger` calls it from worker threads. SQL is written with `?` placeholders; a dialect
that uses another style rewrites them once. Every sum is over integers, so SQLite and
PostgreSQL give the same exact answer.
"""
from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from costd.allocation import split_units
from costd.capacity import MAX_INTERVAL_NS, CapacityRecord
from costd.ledger.config import LedgerConfig
from costd.usage import LedgerBatch, UsageRecord

HOUR_NS = 3_600_000_000_000
END_OF_TIME_NS = 2**63 - 1

_INSERT_USAGE = """
INSERT INTO usage_records (
    request_id, tenant_id, model, request_class, prompt_tokens, cached_prompt_tokens,
    completion_tokens, prefill_device_s, decode_device_s, device_type, worker_id,
    finish_reasons, end_unix_ns, recorded_unix_ns, prefill_device_ns, decode_device_ns)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (request_id) DO NOTHING
"""
_INSERT_CAPACITY = """
INSERT INTO capacity_intervals (
    interval_id, worker_id, device_type, start_unix_ns, end_unix_ns, recorded_unix_ns,
    loading_ns)
VALUES (?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (interval_id) DO NOTHING
"""
_TENANT_USAGE = """
SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_prompt_tokens), 0),
       COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(prefill_device_ns), 0),
       COALESCE(SUM(decode_device_ns), 0)
FROM usage_records
WHERE tenant_id = ? AND end_unix_ns >= ? AND end_unix_ns < ?
"""
_USAGE_BY_HOUR = f"""
SELECT end_unix_ns / {HOUR_NS}, tenant_id, model, request_class, device_type, COUNT(*),
       SUM(prompt_tokens), SUM(cached_prompt_tokens), SUM(completion_tokens),
       SUM(prefill_device_ns), SUM(decode_device_ns)
FROM usage_records
WHERE end_unix_ns >= ? AND end_unix_ns < ?
GROUP BY 1, 2, 3, 4, 5
ORDER BY 1, 2, 3, 4, 5
"""
# Intervals inside one hour and inside the range are summed by the database; the few that
# straddle an hour or the range's edge are split in Python.
_INSIDE = f"""start_unix_ns >= ? AND end_unix_ns <= ?
    AND start_unix_ns / {HOUR_NS} = (end_unix_ns - 1) / {HOUR_NS}"""
_CAPACITY_BY_HOUR = f"""
SELECT start_unix_ns / {HOUR_NS}, device_type, worker_id, SUM(end_unix_ns - start_unix_ns),
       SUM(loading_ns)
FROM capacity_intervals WHERE {_INSIDE}
GROUP BY 1, 2, 3
"""
_CAPACITY_EDGES = f"""
SELECT device_type, worker_id, start_unix_ns, end_unix_ns, loading_ns FROM capacity_intervals
WHERE start_unix_ns >= ? AND start_unix_ns < ? AND end_unix_ns > ? AND NOT ({_INSIDE})
"""
_RECORDS = """
SELECT request_id, tenant_id, model, request_class, prompt_tokens, cached_prompt_tokens,
       completion_tokens, prefill_device_s, decode_device_s, device_type, worker_id,
       finish_reasons, end_unix_ns
FROM usage_records
WHERE end_unix_ns >= ? AND end_unix_ns < ? AND (? = '' OR tenant_id = ?)
ORDER BY end_unix_ns, request_id
"""


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """A tenant's summed usage over a time range; all zeros when it has none."""

    tenant_id: str
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    prefill_device_ns: int = 0
    decode_device_ns: int = 0

    @property
    def prefill_device_s(self) -> float:
        return self.prefill_device_ns / 1e9

    @property
    def decode_device_s(self) -> float:
        return self.decode_device_ns / 1e9


@dataclass(frozen=True, slots=True)
class UsageAggregate:
    """Usage of requests that ended in one hour, for one tenant, model, class and device."""

    hour: int  # hours since the Unix epoch (UTC)
    tenant_id: str
    model: str
    request_class: str
    device_type: str
    num_requests: int
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_completion_tokens: int
    prefill_device_ns: int
    decode_device_ns: int


@dataclass(frozen=True, slots=True)
class CapacityAggregate:
    """One worker's uptime inside one hour (clipped to the queried range)."""

    hour: int
    device_type: str
    worker_id: str
    device_ns: int
    loading_ns: int = 0   # of device_ns, spent loading models


@dataclass(frozen=True, slots=True)
class WriteResult:
    num_new_usage: int
    num_new_capacity: int
    # With write(..., find_known=True): request ids of the batch already in the ledger before
    # this write (repeats, not billed again). Read just before the write: exact with one
    # committer per ledger, which costd is.
    known_request_ids: frozenset[str] = frozenset()


def usage_row(record: UsageRecord, recorded_unix_ns: int) -> tuple:
    return (record.request_id, record.tenant_id, record.model, record.request_class,
            record.num_prompt_tokens, record.num_cached_prompt_tokens,
            record.num_completion_tokens, record.prefill_device_s, record.decode_device_s,
            record.device_type, record.worker_id, json.dumps(list(record.finish_reasons)),
            record.end_unix_ns, recorded_unix_ns, record.prefill_device_ns,
            record.decode_device_ns)


def capacity_row(record: CapacityRecord, recorded_unix_ns: int) -> tuple:
    return (record.interval_id, record.worker_id, record.device_type, record.start_unix_ns,
            record.end_unix_ns, recorded_unix_ns, record.loading_ns)


def split_by_hour(start_ns: int, end_ns: int) -> Iterator[tuple[int, int]]:
    """(hour, ns inside it) for the interval [start, end)."""
    while start_ns < end_ns:
        hour = start_ns // HOUR_NS
        cut = min(end_ns, (hour + 1) * HOUR_NS)
        yield hour, cut - start_ns
        start_ns = cut


class SqlStore(ABC):
    """The ledger's statements; subclasses own connections, transactions and error mapping."""

    def __init__(self, config: LedgerConfig) -> None:
        self.config = config

    @abstractmethod
    def open(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...

    @abstractmethod
    def _writing(self) -> AbstractContextManager[Callable[[str, list[tuple]], int]]:
        """One transaction; yields executemany(sql, rows) -> rows changed; commits on exit."""

    @abstractmethod
    def _read(self, sql: str, params: Sequence) -> list[tuple]: ...

    def write(self, batches: Sequence[LedgerBatch], find_known: bool = False) -> WriteResult:
        """All batches in one transaction (a group commit); repeats are no-ops."""
        now_ns = time.time_ns()
        usage = [usage_row(r, now_ns) for batch in batches for r in batch.usage]
        capacity = [capacity_row(r, now_ns) for batch in batches for r in batch.capacity]
        ids = [row[0] for row in usage] if find_known else []
        known: set[str] = set()
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            known.update(r[0] for r in self._read(
                f"SELECT request_id FROM usage_records WHERE request_id IN ({', '.join('?' * len(chunk))})",
                chunk))
        with self._writing() as executemany:
            new_usage = executemany(_INSERT_USAGE, usage) if usage else 0
            new_capacity = executemany(_INSERT_CAPACITY, capacity) if capacity else 0
        return WriteResult(new_usage, new_capacity, frozenset(known))

    def tenant_usage(self, tenant_id: str, start_ns: int, end_ns: int) -> TenantUsage:
        row = self._read(_TENANT_USAGE, (tenant_id, start_ns, end_ns))[0]
        return TenantUsage(tenant_id, *(int(v) for v in row))

    def usage_by_hour(self, start_ns: int, end_ns: int) -> list[UsageAggregate]:
        rows = self._read(_USAGE_BY_HOUR, (start_ns, end_ns))
        return [UsageAggregate(int(r[0]), r[1], r[2], r[3], r[4], *(int(v) for v in r[5:]))
                for r in rows]

    def capacity_by_hour(self, start_ns: int, end_ns: int) -> list[CapacityAggregate]:
        totals: dict[tuple[int, str, str], list[int]] = {}
        for hour, device, worker, ns, loading in self._read(_CAPACITY_BY_HOUR,
                                                            (start_ns, end_ns)):
            totals[int(hour), device, worker] = [int(ns), int(loading)]
        edges = self._read(_CAPACITY_EDGES, (start_ns - MAX_INTERVAL_NS, end_ns, start_ns,
                                             start_ns, end_ns))
        for device, worker, first_ns, last_ns, loading in edges:
            pieces = list(split_by_hour(int(first_ns), int(last_ns)))
            # Loading time is spread over the interval's hours by their share of it (largest
            # remainder: the pieces sum to the interval's loading time exactly).
            shares = split_units(int(loading), [ns for _, ns in pieces]) or [0] * len(pieces)
            piece_start = int(first_ns)
            for (hour, ns), share in zip(pieces, shares):
                piece_end = piece_start + ns
                inside = min(piece_end, end_ns) - max(piece_start, start_ns)
                if inside > 0:
                    entry = totals.setdefault((hour, device, worker), [0, 0])
                    entry[0] += inside
                    entry[1] += share * inside // ns   # a piece clipped by the range: its part
                piece_start = piece_end
        return [CapacityAggregate(h, d, w, ns, loading)
                for (h, d, w), (ns, loading) in sorted(totals.items())]

    def usage_records(self, start_ns: int, end_ns: int, tenant_id: str = "") -> list[UsageRecord]:
        """Each request that ended in [start, end), of one tenant or ("") of all."""
        rows = self._read(_RECORDS, (start_ns, end_ns, tenant_id, tenant_id))
        return [UsageRecord(*r[:11], tuple(json.loads(r[11])), int(r[12])) for r in rows]

    def usage_records_by_id(self, request_ids: Sequence[str]) -> list[UsageRecord]:
        """The rows of these requests, those the ledger has (for the reconciler)."""
        found: list[UsageRecord] = []
        ids = list(request_ids)
        select = _RECORDS.split("WHERE")[0]
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            rows = self._read(f"{select} WHERE request_id IN ({', '.join('?' * len(chunk))})",
                              chunk)
            found.extend(UsageRecord(*r[:11], tuple(json.loads(r[11])), int(r[12]))
                         for r in rows)
        return found
