"""The cost model: ledger aggregates + price book → priced lines, idle capacity, reconciliation.

A request's cost is its attributed device time (the worker shares each engine step's wall time
among the requests in it) × its device's price; the prompt line carries the prefill time, the
completion line the decode time, so cached prompt tokens cost exactly the (little) time they
used. Loading is the time workers spent loading models (from capacity reports), its own
line. Idle is what the fleet paid for and nobody used: capacity (worker uptime, from capacity
reports) − attributed time − loading, per device and charge period. By policy, idle and
loading are shown as lines of no tenant or shared among the period's tenants pro rata to
their device time.

Exactness: per line, Σ ns × $/hour is summed exactly and divided once, rounded half-even to
1e-9 of the currency; loading is priced like a line; idle is capacity cost − Σ line costs − loading, and pro-rata
shares are split by largest remainder, so per device Σ tenants + unused idle + loading =
capacity × price exactly.
Usage is placed in the hour its request ended; capacity intervals are split across hours.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum

from costd.allocation import split_amount, split_units
from costd.ledger.store import CapacityAggregate, UsageAggregate
from costd.periods import HOUR_NS, Granularity, iso, period_of
from costd.pricebook import Price, PriceBook

NANO = Decimal("0.000000001")
MICRO = Decimal("0.000001")
_NS_PER_HOUR = Decimal(HOUR_NS)


class TokenKind(StrEnum):
    PROMPT = "prompt"
    COMPLETION = "completion"
    IDLE = "idle"
    LOADING = "loading"   # device time spent loading models: capacity, not a request's

    @property
    def capacity(self) -> bool:
        """A kind of capacity no request used (idle, loading), not a request's usage."""
        return self in (TokenKind.IDLE, TokenKind.LOADING)


class IdlePolicy(StrEnum):
    UNUSED = "unused"  # idle stays a line of its own, no tenant's
    PRO_RATA = "pro_rata"  # idle is shared among the period's tenants by device time


def per_million(cost: Decimal, num_tokens: int) -> Decimal | None:
    """Effective cost per 1M tokens, to 1e-6; None without tokens."""
    return (cost * 1_000_000 / num_tokens).quantize(MICRO) if num_tokens else None


@dataclass(frozen=True, slots=True)
class CostLine:
    period_start_ns: int
    period_end_ns: int
    tenant_id: str  # "" for unused capacity
    model: str
    request_class: str
    device: str  # price-book device; the raw device type when the book has none
    token_kind: TokenKind
    num_requests: int
    num_tokens: int
    num_cached_tokens: int
    device_ns: int
    cost: Decimal
    list_cost: Decimal

    @property
    def cost_per_million_tokens(self) -> Decimal | None:
        return per_million(self.cost, self.num_tokens)


@dataclass(frozen=True, slots=True)
class DeviceReconciliation:
    """One device type over the billing range: what was paid for, used, and left idle."""

    device: str
    capacity_ns: int
    attributed_ns: int
    capacity_cost: Decimal
    attributed_cost: Decimal
    idle_allocated_cost: Decimal
    idle_unallocated_cost: Decimal
    loading_ns: int = 0
    loading_cost: Decimal = Decimal(0)

    @property
    def idle_ns(self) -> int:
        return self.capacity_ns - self.attributed_ns - self.loading_ns


@dataclass(frozen=True, slots=True)
class Statement:
    start_ns: int
    end_ns: int
    currency: str
    granularity: Granularity
    idle_policy: IdlePolicy
    lines: tuple[CostLine, ...]
    devices: tuple[DeviceReconciliation, ...]
    worker_capacity_ns: tuple[tuple[str, str, int], ...]  # (device, worker id, uptime ns)
    warnings: tuple[str, ...]

    @property
    def tenant_ids(self) -> list[str]:
        return sorted({line.tenant_id for line in self.lines if line.tenant_id})

    def lines_of(self, tenant_id: str) -> tuple[CostLine, ...]:
        return tuple(line for line in self.lines if line.tenant_id == tenant_id)

    @property
    def capacity_cost(self) -> Decimal:
        return sum((d.capacity_cost for d in self.devices), Decimal(0))

    @property
    def unused_cost(self) -> Decimal:
        """Capacity billed to no tenant: unused idle, and loading under the unused policy."""
        return sum((line.cost for line in self.lines if not line.tenant_id), Decimal(0))


class _Sum:
    """Running totals of one line; money as Σ ns × $/hour, divided once at the end."""

    __slots__ = ("requests", "tokens", "cached", "ns", "cost_num", "list_num")

    def __init__(self) -> None:
        self.requests = self.tokens = self.cached = self.ns = 0
        self.cost_num = self.list_num = Decimal(0)

    def add(self, requests: int, tokens: int, cached: int, ns: int, price: Price | None) -> None:
        self.requests += requests
        self.tokens += tokens
        self.cached += cached
        self.ns += ns
        if price is not None:
            self.cost_num += ns * price.per_hour
            self.list_num += ns * price.list_per_hour

    def costs(self) -> tuple[Decimal, Decimal]:
        return ((self.cost_num / _NS_PER_HOUR).quantize(NANO),
                (self.list_num / _NS_PER_HOUR).quantize(NANO))


class _Builder:
    def __init__(self, book: PriceBook, start_ns: int, end_ns: int,
                 granularity: Granularity) -> None:
        self.book, self.start_ns, self.end_ns = book, start_ns, end_ns
        self.granularity = granularity
        self.usage: dict[tuple, _Sum] = defaultdict(_Sum)
        self.capacity: dict[tuple[int, int, str], _Sum] = defaultdict(_Sum)
        self.loading: dict[tuple[int, int, str], _Sum] = defaultdict(_Sum)
        self.workers: dict[tuple[str, str], int] = defaultdict(int)
        self.warnings: dict[str, None] = {}  # ordered set

    def _priced(self, device_type: str, hour: int, ns: int) -> tuple[str, Price | None]:
        device = self.book.device_for(device_type)
        if device is None:
            if ns:
                self.warnings[f"device type {device_type!r} is not in the price book: "
                              "its device time is billed at 0"] = None
            return device_type, None
        price = self.book.price(device, hour * HOUR_NS)
        if price is None and ns:
            self.warnings[f"device {device!r} has no price at {iso(hour * HOUR_NS)}: "
                          "its device time is billed at 0"] = None
        return device, price

    def add_usage(self, a: UsageAggregate) -> None:
        period = period_of(a.hour, self.start_ns, self.end_ns, self.granularity)
        device, price = self._priced(a.device_type, a.hour,
                                     a.prefill_device_ns + a.decode_device_ns)
        key = (*period, a.tenant_id, a.model, a.request_class, device)
        self.usage[(*key, TokenKind.PROMPT)].add(
            a.num_requests, a.num_prompt_tokens, a.num_cached_prompt_tokens,
            a.prefill_device_ns, price)
        self.usage[(*key, TokenKind.COMPLETION)].add(
            a.num_requests, a.num_completion_tokens, 0, a.decode_device_ns, price)

    def add_capacity(self, c: CapacityAggregate) -> None:
        period = period_of(c.hour, self.start_ns, self.end_ns, self.granularity)
        device, price = self._priced(c.device_type, c.hour, c.device_ns)
        self.capacity[(*period, device)].add(0, 0, 0, c.device_ns, price)
        if c.loading_ns:
            self.loading[(*period, device)].add(0, 0, 0, c.loading_ns, price)
        self.workers[device, c.worker_id] += c.device_ns

    def usage_lines(self) -> list[CostLine]:
        # Prompt before completion on each line pair, as on an invoice.
        # A line with neither tokens nor device time (the completion of a request cancelled
        # before its first token) says nothing; its request is counted on its prompt line.
        order = sorted((k for k, v in self.usage.items() if v.tokens or v.ns),
                       key=lambda k: (*k[:-1], k[-1] is TokenKind.COMPLETION))
        return [CostLine(*key, self.usage[key].requests, self.usage[key].tokens,
                         self.usage[key].cached, self.usage[key].ns, *self.usage[key].costs())
                for key in order]


def _unattributed_lines(period_device: tuple[int, int, str], used: Sequence[CostLine],
                        kind: TokenKind, ns: int, cost: Decimal, list_cost: Decimal,
                        policy: IdlePolicy) -> list[CostLine]:
    """Capacity no request used (idle or loading) of one device in one period: one line of
    no tenant, or (pro rata) one share per tenant by device time."""
    start_ns, end_ns, device = period_device
    by_tenant: dict[str, int] = defaultdict(int)
    for line in used:
        by_tenant[line.tenant_id] += line.device_ns
    tenants = sorted(by_tenant)
    weights = [by_tenant[t] for t in tenants]
    shares = split_amount(cost, weights, NANO) if policy is IdlePolicy.PRO_RATA else None
    if shares is None:
        return [CostLine(start_ns, end_ns, "", "", "", device, kind, 0, 0, 0,
                         ns, cost, list_cost)]
    list_shares = split_amount(list_cost, weights, NANO)
    ns_shares = split_units(ns, weights)
    return [CostLine(start_ns, end_ns, tenant, "", "", device, kind, 0, 0, 0,
                     ns, share, list_share)
            for tenant, share, list_share, ns in zip(tenants, shares, list_shares, ns_shares)]


def _idle_lines(period_device: tuple[int, int, str], used: Sequence[CostLine],
                capacity: _Sum | None, loading: _Sum | None,
                policy: IdlePolicy) -> tuple[list[CostLine], list[str]]:
    """Loading and idle lines of one device in one period, and warnings about them."""
    if capacity is None and all(line.cost == 0 and line.list_cost == 0 for line in used):
        return [], []  # unpriced or device-less usage: no money to reconcile
    capacity = capacity or _Sum()
    cost, list_cost = capacity.costs()
    lines: list[CostLine] = []
    loading_cost = loading_list = Decimal(0)
    if loading is not None and loading.ns:
        loading_cost, loading_list = loading.costs()
        lines = _unattributed_lines(period_device, used, TokenKind.LOADING, loading.ns,
                                    loading_cost, loading_list, policy)
    idle_cost = cost - sum((line.cost for line in used), Decimal(0)) - loading_cost
    idle_list = list_cost - sum((line.list_cost for line in used), Decimal(0)) - loading_list
    idle_ns = capacity.ns - sum(line.device_ns for line in used) - (loading.ns if loading else 0)
    start_ns, end_ns, device = period_device
    warnings = []
    if idle_ns < 0:
        warnings.append(f"{device}: attributed device time exceeds reported capacity by "
                        f"{-idle_ns / 1e9:.3f} s in [{iso(start_ns)}, {iso(end_ns)}) — a "
                        "request's device time counts where the request ended, so a window of "
                        "seconds over a busy device can show this; over hours, check that its "
                        "workers send capacity reports")
    if idle_ns == 0 and idle_cost == 0 and idle_list == 0:
        return lines, warnings
    return lines + _unattributed_lines(period_device, used, TokenKind.IDLE, idle_ns, idle_cost,
                                       idle_list, policy), warnings


def _reconcile(lines: Iterable[CostLine], capacity: dict[tuple[int, int, str], _Sum]
               ) -> tuple[DeviceReconciliation, ...]:
    totals: dict[str, list] = defaultdict(lambda: [0, 0, Decimal(0), Decimal(0), Decimal(0),
                                                   Decimal(0), 0, Decimal(0)])
    for (_, _, device), total in capacity.items():
        totals[device][0] += total.ns
        totals[device][2] += total.costs()[0]
    for line in lines:
        entry = totals[line.device]
        if line.token_kind is TokenKind.LOADING:
            entry[6] += line.device_ns
            entry[7] += line.cost
        elif line.token_kind is not TokenKind.IDLE:
            entry[1] += line.device_ns
            entry[3] += line.cost
        elif line.tenant_id:
            entry[4] += line.cost
        else:
            entry[5] += line.cost
    # A device nobody paid for and that cost nothing (unpriced, or no device at all) has no
    # books to balance; the statement's warnings already name it.
    return tuple(DeviceReconciliation(device, *values)
                 for device, values in sorted(totals.items())
                 if values[0] or any(values[2:]))


def build_statement(usage: Iterable[UsageAggregate], capacity: Iterable[CapacityAggregate],
                    book: PriceBook, start_ns: int, end_ns: int,
                    granularity: Granularity = Granularity.TOTAL,
                    policy: IdlePolicy = IdlePolicy.UNUSED) -> Statement:
    builder = _Builder(book, start_ns, end_ns, granularity)
    for aggregate in usage:
        builder.add_usage(aggregate)
    for interval in capacity:
        builder.add_capacity(interval)
    lines = builder.usage_lines()
    by_period_device: dict[tuple[int, int, str], list[CostLine]] = defaultdict(list)
    for line in lines:
        by_period_device[line.period_start_ns, line.period_end_ns, line.device].append(line)
    warnings = list(builder.warnings)
    for key in sorted(set(by_period_device) | set(builder.capacity)):
        idle, notes = _idle_lines(key, by_period_device.get(key, []),
                                  builder.capacity.get(key), builder.loading.get(key), policy)
        lines.extend(idle)
        warnings.extend(notes)
    return Statement(start_ns, end_ns, book.currency, granularity, policy, tuple(lines),
                     _reconcile(lines, builder.capacity),
                     tuple((d, w, ns) for (d, w), ns in sorted(builder.workers.items())),
                     tuple(warnings))
