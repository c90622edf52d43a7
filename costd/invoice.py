"""Invoices: one tenant's priced lines over a billing range, its totals and effective rates.

Lines keep 1e-9 of the currency; the amount due is the total rounded half-even to the cent.
Across the fleet, whatever those per-tenant roundings leave over goes to unused capacity, so
Σ tenants' amounts due + unused = the fleet's capacity cost in cents, exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal

from costd.costmodel import CostLine, Statement, TokenKind, per_million

CENT = Decimal("0.01")


def to_cents(amount: Decimal) -> Decimal:
    return amount.quantize(CENT, rounding=ROUND_HALF_EVEN)


def _cost(lines: tuple[CostLine, ...], kind: TokenKind) -> Decimal:
    return sum((line.cost for line in lines if line.token_kind is kind), Decimal(0))


def _tokens(lines: tuple[CostLine, ...], kind: TokenKind) -> int:
    return sum(line.num_tokens for line in lines if line.token_kind is kind)


@dataclass(frozen=True, slots=True)
class Invoice:
    tenant_id: str
    start_ns: int
    end_ns: int
    currency: str
    lines: tuple[CostLine, ...]  # usage lines, then idle and loading shares (pro-rata only)

    @property
    def num_requests(self) -> int:
        # Each request is on one prompt line and one completion line: count it once.
        return sum(l.num_requests for l in self.lines if l.token_kind is TokenKind.PROMPT)

    @property
    def num_prompt_tokens(self) -> int:
        return _tokens(self.lines, TokenKind.PROMPT)

    @property
    def num_cached_prompt_tokens(self) -> int:
        return sum(l.num_cached_tokens for l in self.lines)

    @property
    def num_completion_tokens(self) -> int:
        return _tokens(self.lines, TokenKind.COMPLETION)

    @property
    def prompt_cost(self) -> Decimal:
        return _cost(self.lines, TokenKind.PROMPT)

    @property
    def completion_cost(self) -> Decimal:
        return _cost(self.lines, TokenKind.COMPLETION)

    @property
    def idle_cost(self) -> Decimal:
        return _cost(self.lines, TokenKind.IDLE)

    @property
    def loading_cost(self) -> Decimal:
        return _cost(self.lines, TokenKind.LOADING)

    @property
    def total(self) -> Decimal:
        return sum((line.cost for line in self.lines), Decimal(0))

    @property
    def amount_due(self) -> Decimal:
        return to_cents(self.total)

    @property
    def prompt_cost_per_million(self) -> Decimal | None:
        return per_million(self.prompt_cost, self.num_prompt_tokens)

    @property
    def completion_cost_per_million(self) -> Decimal | None:
        return per_million(self.completion_cost, self.num_completion_tokens)


def invoice_for(statement: Statement, tenant_id: str) -> Invoice:
    """The tenant's invoice; an empty one (not an error) when it used nothing."""
    return Invoice(tenant_id, statement.start_ns, statement.end_ns, statement.currency,
                   statement.lines_of(tenant_id))


@dataclass(frozen=True, slots=True)
class FleetTotals:
    """capacity = tenants + unused, exactly at 1e-9 and again in cents (amounts due)."""

    capacity_cost: Decimal
    tenants_cost: Decimal
    unused_cost: Decimal
    capacity_due: Decimal
    tenants_due: Decimal
    unused_due: Decimal


def fleet_totals(statement: Statement, invoices: list[Invoice]) -> FleetTotals:
    tenants_cost = sum((i.total for i in invoices), Decimal(0))
    tenants_due = sum((i.amount_due for i in invoices), Decimal(0))
    capacity_due = to_cents(statement.capacity_cost)
    return FleetTotals(statement.capacity_cost, tenants_cost, statement.unused_cost,
                       capacity_due, tenants_due, capacity_due - tenants_due)
