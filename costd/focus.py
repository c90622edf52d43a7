"""FinOps FOCUS 1.x rows from a statement: one row per priced line (and per idle line).

The SKU we price is the device-hour: PricingQuantity is device-hours, PricingUnit "Hours";
what was consumed is tokens (ConsumedUnit "Tokens"), or device-hours on idle rows.
BilledCost = EffectiveCost = ContractedCost = device time × our price (self-hosted: no
discounts or commitments on top); ListCost uses the price book's list price. Our own columns
are prefixed x_ as FOCUS asks: x_TenantId, x_Model, x_RequestClass, x_TokenKind,
x_CachedTokens, x_Requests, x_DeviceSeconds, x_CostPerMillionTokens.
"""
from __future__ import annotations

from decimal import Decimal

from costd.costmodel import NANO, CostLine, Statement, TokenKind
from costd.export import Column, Kind, Table

SERVICE_NAME = "llmmesh"
SERVICE_CATEGORY = "AI and Machine Learning"
PROVIDER = "llmmesh"
BILLING_ACCOUNT_NAME = "llmmesh inference platform"
_HOURS_PER_NS = Decimal(1) / Decimal(3_600_000_000_000)

FOCUS_COLUMNS = tuple(Column(name, kind) for name, kind in (
    ("BillingAccountId", Kind.TEXT), ("BillingAccountName", Kind.TEXT),
    ("BillingCurrency", Kind.TEXT),
    ("BillingPeriodStart", Kind.TIME), ("BillingPeriodEnd", Kind.TIME),
    ("ChargePeriodStart", Kind.TIME), ("ChargePeriodEnd", Kind.TIME),
    ("ChargeCategory", Kind.TEXT), ("ChargeClass", Kind.TEXT),
    ("ChargeDescription", Kind.TEXT), ("ChargeFrequency", Kind.TEXT),
    ("BilledCost", Kind.DECIMAL), ("EffectiveCost", Kind.DECIMAL),
    ("ListCost", Kind.DECIMAL), ("ContractedCost", Kind.DECIMAL),
    ("ConsumedQuantity", Kind.DECIMAL), ("ConsumedUnit", Kind.TEXT),
    ("PricingQuantity", Kind.DECIMAL), ("PricingUnit", Kind.TEXT),
    ("ServiceName", Kind.TEXT), ("ServiceCategory", Kind.TEXT),
    ("ProviderName", Kind.TEXT), ("PublisherName", Kind.TEXT),
    ("InvoiceIssuerName", Kind.TEXT), ("ResourceId", Kind.TEXT),
    ("ResourceName", Kind.TEXT), ("ResourceType", Kind.TEXT), ("SkuId", Kind.TEXT),
    # FOCUS 1.3+ names for the provider columns above (kept both ways for 1.0-1.2 readers).
    ("HostProviderName", Kind.TEXT), ("ServiceProviderName", Kind.TEXT),
    # We publish a price per device-hour: unit prices, the price's id, the meter.
    ("ListUnitPrice", Kind.DECIMAL), ("ContractedUnitPrice", Kind.DECIMAL),
    ("SkuPriceId", Kind.TEXT), ("SkuMeter", Kind.TEXT), ("SkuPriceDetails", Kind.JSON),
    # Tenants are the sub accounts of the one billing account.
    ("SubAccountId", Kind.TEXT), ("SubAccountName", Kind.TEXT),
    ("Tags", Kind.JSON), ("x_TenantId", Kind.TEXT), ("x_Model", Kind.TEXT),
    ("x_RequestClass", Kind.TEXT), ("x_TokenKind", Kind.TEXT),
    ("x_CachedTokens", Kind.INT), ("x_Requests", Kind.INT),
    ("x_DeviceSeconds", Kind.DECIMAL), ("x_CostPerMillionTokens", Kind.DECIMAL),
))


def device_hours(device_ns: int) -> Decimal:
    return (device_ns * _HOURS_PER_NS).quantize(NANO)


def describe(line: CostLine) -> str:
    if line.token_kind is TokenKind.IDLE:
        if line.tenant_id:
            return f"Share of idle {line.device} capacity (pro rata to device time)"
        return f"Unused {line.device} capacity"
    if line.token_kind is TokenKind.LOADING:
        if line.tenant_id:
            return f"Share of {line.device} time spent loading models (pro rata to device time)"
        return f"{line.device} time spent loading models"
    return (f"{line.model or 'unknown model'} {line.token_kind} tokens, "
            f"{line.request_class or 'unclassified'} class, on {line.device or 'no device'}")


def _tags(line: CostLine) -> dict[str, str]:
    tags = {"llmmesh/tenant": line.tenant_id, "llmmesh/model": line.model,
            "llmmesh/request-class": line.request_class}
    return {k: v for k, v in tags.items() if v}


def _unit_price(cost: Decimal, device_ns: int) -> Decimal | None:
    """Price per device-hour of the line: its cost over its exact device time (the book's
    price, unless a price change falls inside the line's period: then their blend)."""
    return (cost * 3_600_000_000_000 / device_ns).quantize(NANO) if device_ns else None


def focus_row(statement: Statement, line: CostLine) -> tuple:
    hours = device_hours(line.device_ns)
    consumed, unit = (hours, "Hours") if line.token_kind.capacity else (Decimal(line.num_tokens), "Tokens")
    price, list_price = _unit_price(line.cost, line.device_ns), _unit_price(line.list_cost, line.device_ns)
    return (
        PROVIDER, BILLING_ACCOUNT_NAME, statement.currency, statement.start_ns, statement.end_ns,
        line.period_start_ns, line.period_end_ns, "Usage", None, describe(line),
        "Usage-Based", line.cost, line.cost, line.list_cost, line.cost,
        consumed, unit, hours, "Hours", SERVICE_NAME, SERVICE_CATEGORY, PROVIDER, PROVIDER,
        PROVIDER, f"llmmesh/device/{line.device}" if line.device else None,
        line.device or None, "Device" if line.device else None, line.device or None,
        PROVIDER, PROVIDER, list_price, price,
        f"{line.device}@{price}/h" if line.device and price is not None else None,
        "Device time" if line.device else None,
        {"device": line.device, "pricing_unit": "Hours"} if line.device else None,
        line.tenant_id or None, line.tenant_id or None,
        _tags(line), line.tenant_id or None, line.model or None, line.request_class or None,
        line.token_kind.value, line.num_cached_tokens, line.num_requests,
        (Decimal(line.device_ns) / 1_000_000_000).quantize(NANO),
        line.cost_per_million_tokens,
    )


def focus_table(statement: Statement, lines: tuple[CostLine, ...]) -> Table:
    return Table(FOCUS_COLUMNS, [focus_row(statement, line) for line in lines])


INVOICE_COLUMNS = tuple(Column(name, kind) for name, kind in (
    ("period_start", Kind.TIME), ("period_end", Kind.TIME), ("tenant_id", Kind.TEXT),
    ("model", Kind.TEXT), ("request_class", Kind.TEXT), ("device", Kind.TEXT),
    ("token_kind", Kind.TEXT), ("requests", Kind.INT), ("tokens", Kind.INT),
    ("cached_tokens", Kind.INT), ("device_seconds", Kind.DECIMAL), ("cost", Kind.DECIMAL),
    ("list_cost", Kind.DECIMAL), ("cost_per_million_tokens", Kind.DECIMAL),
    ("currency", Kind.TEXT),
))


def invoice_table(statement: Statement, lines: tuple[CostLine, ...]) -> Table:
    return Table(INVOICE_COLUMNS, [(
        line.period_start_ns, line.period_end_ns, line.tenant_id, line.model,
        line.request_class, line.device, line.token_kind.value, line.num_requests,
        line.num_tokens, line.num_cached_tokens,
        (Decimal(line.device_ns) / 1_000_000_000).quantize(NANO), line.cost, line.list_cost,
        line.cost_per_million_tokens, statement.currency) for line in lines])
