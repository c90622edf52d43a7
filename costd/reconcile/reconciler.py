"""The reconciler: what Redis says was billed (settled admissions, billing records) against the
ledger's rows, and the repair of a bill the ledger lacks while its record is still in Redis.

For a window, every request Redis saw end in it — settled with tokens used
(llmmesh.admission's settlement index) or holding a record in `llmmesh:billing`, shipped or
not — is looked up in the ledger by request id, and every ledger row of the window is looked up
in Redis. Three kinds of gap:
- unbilled: Redis knows the request used tokens, the ledger has no row. Repairable while its
  record is in the stream (written to the ledger as costd's receiver would; the ledger keeps
  the first row per request id, so a repair never bills twice); a settlement alone is reported
  with what it knows (tenant, tokens) as unrepairable.
- mismatch: the ledger's token counts differ from the record's, or from what admission charged.
- unknown: a ledger row of which Redis holds neither record nor settlement although the stream
  still holds everything written at its time. A row older than the stream's horizon (records
  trimmed after RETENTION_S, or deleted by an older shipper) is counted as expired, not a gap.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

import redis.asyncio as aioredis

from costd.ledger import UsageLedger
from costd.usage import LedgerBatch, MalformedUsage, UsageRecord, record_from_span
from llmmesh import admission, billing
from llmmesh.admission import Settlement
from llmmesh.billing import BillingRecord

UNBILLED, MISMATCH, UNKNOWN = "unbilled", "mismatch", "unknown"
# Routers' clocks (a bill's end time) against Redis's (stream ids, settle times): lookups reach
# this far past the window's edges.
CLOCK_SLACK_MS = 300_000
DEFAULT_GRACE_S = 60.0


@dataclass(slots=True)
class Gap:
    kind: str
    request_id: str
    tenant_id: str
    redis_tokens: int | None     # prompt + completion that Redis says were used
    ledger_tokens: int | None    # prompt + completion the ledger billed; None: no row
    detail: str
    repairable: bool = False
    repaired: bool = False


@dataclass(slots=True)
class Report:
    start_unix_ms: int
    end_unix_ms: int
    horizon_unix_ms: int     # before it, Redis may have dropped records (llmmesh.billing)
    num_settled: int = 0     # settlements with tokens used in the window
    num_records: int = 0     # billing records in the window
    num_ledger_rows: int = 0
    num_matched: int = 0     # requests Redis and the ledger agree on
    num_expired: int = 0     # ledger rows Redis no longer remembers, older than the horizon
    gaps: list[Gap] = field(default_factory=list)

    @property
    def open_gaps(self) -> list[Gap]:
        return [g for g in self.gaps if not g.repaired]

    @property
    def num_repaired(self) -> int:
        return sum(g.repaired for g in self.gaps)

    def to_dict(self) -> dict:
        return {**asdict(self), "num_repaired": self.num_repaired,
                "num_open_gaps": len(self.open_gaps)}


def _tokens(r: BillingRecord | UsageRecord) -> tuple[int, int, int]:
    # Both spell their counts alike.
    return r.num_prompt_tokens, r.num_cached_prompt_tokens, r.num_completion_tokens


def _spelled(tokens: tuple[int, int, int]) -> str:
    return f"prompt {tokens[0]} (cached {tokens[1]}), completion {tokens[2]}"


def usage_record_of(record: BillingRecord) -> UsageRecord:
    """The ledger row a record makes, through the same span costd's receiver would get."""
    request = billing.export_request([(record.entry_id, record.fields)])
    (span,) = request.resource_spans[0].scope_spans[0].spans
    usage = record_from_span(span)
    if usage is None:
        raise MalformedUsage("the record is not a final usage span")
    return usage


class Reconciler:
    """`redis` decodes responses; `ledger` is started (its committer writes repairs)."""

    def __init__(self, redis: aioredis.Redis, ledger: UsageLedger,
                 grace_s: float = DEFAULT_GRACE_S) -> None:
        self.redis, self.ledger = redis, ledger
        # What ended this recently may still be on its way (the shipper's next export).
        self.grace_ms = int(grace_s * 1000)

    async def run(self, since_s: float, repair: bool = False) -> Report:
        seconds, micros = await self.redis.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        report = Report(now_ms - int(since_s * 1000), now_ms - self.grace_ms, 0)
        # Redis first, the ledger after: a record shipped in between is then found billed,
        # never reported missing.
        reach_ms = report.start_unix_ms - CLOCK_SLACK_MS
        records: dict[str, list[BillingRecord]] = defaultdict(list)
        for r in await billing.read_records(self.redis, reach_ms):
            records[r.request_id].append(r)
        settled = {s.request_id: s for s in await admission.read_settlements(self.redis, reach_ms)}
        report.horizon_unix_ms = await billing.horizon_unix_ms(self.redis)
        ended = self._ended_in(report, records, settled)
        store = self.ledger.store
        rows = {r.request_id: r for r in await self.ledger.query(store.usage_records_by_id,
                                                                 sorted(ended))}
        for request_id in sorted(ended):
            self._compare(report, request_id, records.get(request_id, []),
                          settled.get(request_id), rows.get(request_id))
        window = await self.ledger.query(store.usage_records, report.start_unix_ms * 1_000_000,
                                         (report.end_unix_ms + 1) * 1_000_000)
        report.num_ledger_rows = len(window)
        for row in window:
            if row.request_id not in records and row.request_id not in settled:
                self._unknown(report, row)
        if repair:
            await self._repair(report, records)
        return report

    @staticmethod
    def _ended_in(report: Report, records: dict[str, list[BillingRecord]],
                  settled: dict[str, Settlement]) -> set[str]:
        inside = range(report.start_unix_ms, report.end_unix_ms + 1)
        ended = {rid for rid, rs in records.items() if any(r.unix_ms in inside for r in rs)}
        report.num_records = len(ended)
        used = {s.request_id for s in settled.values()
                if s.settled_unix_ms in inside and s.used_tokens > 0}
        report.num_settled = len(used)
        # A settlement of 0 tokens ended unbilled: a gap only if the ledger billed it anyway.
        zero = {s.request_id for s in settled.values()
                if s.settled_unix_ms in inside and s.used_tokens == 0}
        return ended | used | zero

    @staticmethod
    def _compare(report: Report, request_id: str, records: list[BillingRecord],
                 settlement: Settlement | None, row: UsageRecord | None) -> None:
        tenant_id = records[0].tenant_id if records else settlement.tenant_id
        used = settlement.used_tokens if settlement else None
        if row is None:
            if records:
                first = records[0]
                state = "shipped, yet not in the ledger" if first.shipped else "waits for a shipper"
                report.gaps.append(Gap(UNBILLED, request_id, tenant_id,
                                       first.num_prompt_tokens + first.num_completion_tokens,
                                       None, f"record {first.entry_id} {state}: "
                                       f"{_spelled(_tokens(first))}", repairable=True))
            elif used:
                report.gaps.append(Gap(UNBILLED, request_id, tenant_id, used, None,
                                       f"settled with {used} tokens; its billing record is gone "
                                       "(unrepairable)"))
            return
        billed = row.num_prompt_tokens + row.num_completion_tokens
        problems = []
        if records and not any(_tokens(r) == _tokens(row) for r in records):
            problems.append(f"record {_spelled(_tokens(records[0]))} vs ledger "
                            f"{_spelled(_tokens(row))}")
        if used is not None and used != billed:
            problems.append(f"admission charged {used} tokens vs ledger {billed}")
        if row.tenant_id != tenant_id:
            problems.append(f"ledger bills tenant {row.tenant_id}")
        if problems:
            redis_tokens = (records[0].num_prompt_tokens + records[0].num_completion_tokens
                            if records else used)
            report.gaps.append(Gap(MISMATCH, request_id, tenant_id, redis_tokens, billed,
                                   "; ".join(problems)))
        else:
            report.num_matched += 1

    @staticmethod
    def _unknown(report: Report, row: UsageRecord) -> None:
        if row.end_unix_ns // 1_000_000 < report.horizon_unix_ms + CLOCK_SLACK_MS:
            report.num_expired += 1    # Redis dropped its record: nothing left to compare
            return
        report.gaps.append(Gap(UNKNOWN, row.request_id, row.tenant_id, None,
                               row.num_prompt_tokens + row.num_completion_tokens,
                               "billed, but Redis holds neither its record nor its settlement"))

    async def _repair(self, report: Report, records: dict[str, list[BillingRecord]]) -> None:
        todo: list[tuple[Gap, UsageRecord]] = []
        for gap in report.gaps:
            if not gap.repairable:
                continue
            try:   # the first record written, the one the ledger would have kept
                todo.append((gap, usage_record_of(records[gap.request_id][0])))
            except MalformedUsage as error:
                gap.repairable = False
                gap.detail += f"; costd refuses it: {error}"
        if not todo:
            return
        await self.ledger.consume(LedgerBatch(tuple(usage for _, usage in todo)))
        present = {r.request_id for r in await self.ledger.query(
            self.ledger.store.usage_records_by_id, [g.request_id for g, _ in todo])}
        for gap, _ in todo:
            gap.repaired = gap.request_id in present
