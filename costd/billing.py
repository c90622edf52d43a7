"""Billing, transport-free: ledger + price book → statements, invoices and export files.

The servicer converts proto ↔ these calls; tests drive this object directly.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from costd import cloudevents
from costd.costmodel import IdlePolicy, Statement, build_statement
from costd.export import CONTENT_TYPES, ExportFormat, encode
from costd.focus import focus_table, invoice_table
from costd.invoice import FleetTotals, Invoice, fleet_totals, invoice_for
from costd.ledger import UsageLedger
from costd.periods import Granularity
from costd.pricebook import PriceBook
from llmmesh.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class BillingQuery:
    start_ns: int
    end_ns: int
    tenant_id: str = ""  # "" = every tenant
    granularity: Granularity = Granularity.TOTAL
    idle_policy: IdlePolicy = IdlePolicy.UNUSED

    def __post_init__(self) -> None:
        if self.start_ns < 0:
            raise InvalidArgument("start_unix_s", "must be >= 0")
        if self.end_ns < self.start_ns:
            raise InvalidArgument("end_unix_s", "is before start_unix_s")


@dataclass(frozen=True, slots=True)
class InvoiceSet:
    statement: Statement
    invoices: tuple[Invoice, ...]
    fleet: FleetTotals | None  # only when every tenant was asked for


@dataclass(frozen=True, slots=True)
class ExportFile:
    data: bytes
    num_rows: int
    content_type: str
    extension: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


class Schema:
    FOCUS = "focus"
    INVOICE_LINES = "invoice_lines"
    CLOUDEVENTS = "cloudevents"


class Billing:
    def __init__(self, ledger: UsageLedger, book: PriceBook) -> None:
        self.ledger = ledger
        self.book = book

    def statement(self, query: BillingQuery) -> Statement:
        """Blocking (runs SQL): call from a worker thread."""
        store = self.ledger.store
        # Always the whole fleet: idle shares and reconciliation need every tenant.
        return build_statement(store.usage_by_hour(query.start_ns, query.end_ns),
                               store.capacity_by_hour(query.start_ns, query.end_ns),
                               self.book, query.start_ns, query.end_ns, query.granularity,
                               query.idle_policy)

    def invoices(self, query: BillingQuery) -> InvoiceSet:
        statement = self.statement(query)
        if query.tenant_id:
            return InvoiceSet(statement, (invoice_for(statement, query.tenant_id),), None)
        invoices = tuple(invoice_for(statement, t) for t in statement.tenant_ids)
        return InvoiceSet(statement, invoices, fleet_totals(statement, list(invoices)))

    def export(self, query: BillingQuery, schema: str, fmt: ExportFormat) -> ExportFile:
        if schema == Schema.CLOUDEVENTS:
            return self._cloudevents(query, fmt)
        statement = self.statement(query)
        lines = (statement.lines_of(query.tenant_id) if query.tenant_id
                 else statement.lines)
        build = focus_table if schema == Schema.FOCUS else invoice_table
        table = build(statement, lines)
        return ExportFile(encode(table, fmt), len(table.rows), CONTENT_TYPES[fmt], fmt.value)

    def _cloudevents(self, query: BillingQuery, fmt: ExportFormat) -> ExportFile:
        if fmt is not ExportFormat.JSONL:
            raise InvalidArgument("format", "CloudEvents are exported as JSONL only")
        records = self.ledger.store.usage_records(query.start_ns, query.end_ns,
                                                  query.tenant_id)
        data, num_rows = cloudevents.to_jsonl(records, self.book)
        return ExportFile(data, num_rows, cloudevents.CONTENT_TYPE, "jsonl")
