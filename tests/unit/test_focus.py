"""FOCUS rows and the file encodings: exact decimal money in CSV, JSONL and Parquet; CloudEvents."""
from __future__ import annotations

import csv
import io
import json
from decimal import Decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from costd import cloudevents
from costd.costmodel import IdlePolicy, build_statement
from costd.export import ExportFormat, encode
from costd.focus import FOCUS_COLUMNS, focus_table, invoice_table
from costd.ledger import CapacityAggregate, UsageAggregate
from costd.pricebook import PriceBook
from costd.usage import UsageRecord

S = 1_000_000_000
H = 3600 * S
HOUR0 = 480_000
BOOK = PriceBook.parse("""
currency = "USD"
[devices.cpu]
prices = [{ from = 2024-01-01T00:00:00Z, per_hour = 3.60, list_per_hour = 7.20 }]
""")
REQUIRED = {"BilledCost", "EffectiveCost", "ListCost", "ContractedCost", "ChargePeriodStart",
            "ChargePeriodEnd", "BillingPeriodStart", "BillingPeriodEnd", "BillingCurrency",
            "ConsumedQuantity", "ConsumedUnit", "PricingQuantity", "PricingUnit", "ServiceName",
            "ServiceCategory", "ChargeCategory", "ChargeDescription", "ResourceId", "Tags",
            "x_TenantId", "x_Model", "x_RequestClass", "x_TokenKind"}


@pytest.fixture
def statement():
    usage = [UsageAggregate(HOUR0, "acme", "m", "batch", "cpu", 2, 100, 40, 50, 1_500_000_000,
                            6_000_000_000)]
    capacity = [CapacityAggregate(HOUR0, "cpu", "w0", 3600 * S)]
    return build_statement(usage, capacity, BOOK, HOUR0 * H, (HOUR0 + 1) * H,
                           policy=IdlePolicy.UNUSED)


def rows_of_csv(data: bytes) -> list[dict]:
    return list(csv.DictReader(io.StringIO(data.decode())))


def focus_spec_columns() -> dict[str, dict]:
    """The FOCUS 1.4 Cost and Usage columns as the FinOps Foundation's data model lists them
    (the machine-readable model shipped in focus-data-toolkit), not a hand-kept subset."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("focus_data_toolkit")
    path = os.path.join(list(spec.submodule_search_locations)[0], "model", "focus_1_4_model.json")
    with open(path) as f:
        return json.load(f)["datasets"]["Cost and Usage"]["columns"]


# Conditional columns whose condition holds for us: we measure usage, bill provisioned
# resources (devices) with types, publish unit prices (per device-hour), have sub accounts
# (tenants), set tags. The others (commitments, capacity reservations, regions, split
# allocation, virtual currencies, several account types, payable invoices) do not apply.
APPLICABLE_CONDITIONAL = {
    "ConsumedQuantity", "ConsumedUnit", "ResourceId", "ResourceName", "ResourceType",
    "ListUnitPrice", "ContractedUnitPrice", "SkuId", "SkuMeter", "SkuPriceDetails", "SkuPriceId",
    "SubAccountId", "SubAccountName", "Tags"}


def test_focus_has_every_mandatory_spec_column_and_the_conditional_ones_that_apply():
    spec = focus_spec_columns()
    mandatory = {n for n, c in spec.items() if c["feature_level"] == "Mandatory" and not c["deprecated"]}
    assert len(mandatory) >= 20 and "BillingAccountName" in mandatory   # the list is the spec's
    names = {c.name for c in FOCUS_COLUMNS}
    assert mandatory - names == set()
    assert APPLICABLE_CONDITIONAL <= {n for n, c in spec.items() if c["feature_level"] == "Conditional"}
    assert APPLICABLE_CONDITIONAL - names == set()
    assert REQUIRED <= names
    # Every other column is either the spec's or ours, prefixed x_ as the spec asks.
    assert all(n in spec or n.startswith("x_") or n in ("ProviderName", "PublisherName",
                                                          "ChargeFrequency") for n in names)


def test_focus_rows_fill_the_mandatory_non_nullable_columns(statement):
    spec = focus_spec_columns()
    rows = rows_of_csv(encode(focus_table(statement, statement.lines), ExportFormat.CSV))
    required = [n for n, c in spec.items() if c["feature_level"] == "Mandatory"
                and not c["deprecated"] and not c["allows_nulls"]]
    for row in rows:
        assert [n for n in required if row[n] == ""] == []
    prompt = rows[0]
    assert prompt["SubAccountId"] == prompt["x_TenantId"] == "acme"
    assert Decimal(prompt["ContractedUnitPrice"]) == Decimal("3.60")
    assert Decimal(prompt["ListUnitPrice"]) == Decimal("7.20")
    assert prompt["SkuPriceId"] == "cpu@3.600000000/h" and prompt["BillingAccountName"]


def test_loading_rows_are_device_hours_of_their_own_kind():
    usage = [UsageAggregate(HOUR0, "acme", "m", "batch", "cpu", 2, 100, 40, 50, 1_500_000_000,
                            6_000_000_000)]
    capacity = [CapacityAggregate(HOUR0, "cpu", "w0", 3600 * S, 360 * S)]
    s = build_statement(usage, capacity, BOOK, HOUR0 * H, (HOUR0 + 1) * H)
    rows = rows_of_csv(encode(focus_table(s, s.lines), ExportFormat.CSV))
    (loading,) = [r for r in rows if r["x_TokenKind"] == "loading"]
    assert (loading["ConsumedUnit"], Decimal(loading["ConsumedQuantity"])) == ("Hours",
                                                                             Decimal("0.1"))
    assert loading["ChargeDescription"] == "cpu time spent loading models"
    assert Decimal(loading["EffectiveCost"]) == Decimal("0.36")   # 0.1 h at $3.60
    (idle,) = [r for r in rows if r["x_TokenKind"] == "idle"]
    # 3600 s − 360 loading − 7.5 of requests, in hours to 1e-9
    assert Decimal(idle["ConsumedQuantity"]) == Decimal("0.897916667")


def test_focus_csv_rows_are_exact(statement):
    prompt, completion, idle = rows_of_csv(encode(focus_table(statement, statement.lines),
                                                  ExportFormat.CSV))
    assert prompt["BilledCost"] == prompt["EffectiveCost"] == "0.001500000"
    assert prompt["ListCost"] == "0.003000000"  # list price is twice ours
    assert (prompt["ConsumedQuantity"], prompt["ConsumedUnit"]) == ("100", "Tokens")
    assert (prompt["PricingQuantity"], prompt["PricingUnit"]) == ("0.000416667", "Hours")
    assert prompt["ChargePeriodStart"] == "2024-10-04T00:00:00Z"
    assert (prompt["x_TenantId"], prompt["x_TokenKind"], prompt["x_CachedTokens"]) == (
        "acme", "prompt", "40")
    assert json.loads(prompt["Tags"]) == {"llmmesh/tenant": "acme", "llmmesh/model": "m",
                                          "llmmesh/request-class": "batch"}
    assert completion["x_CostPerMillionTokens"] == "120.000000"
    assert (idle["x_TenantId"], idle["x_TokenKind"], idle["ConsumedUnit"]) == ("", "idle",
                                                                               "Hours")
    assert idle["BilledCost"] == "3.592500000"
    total = sum(Decimal(r["BilledCost"]) for r in (prompt, completion, idle))
    assert total == Decimal("3.6")  # one cpu-hour


def test_jsonl_keeps_money_as_decimal_strings(statement):
    lines = encode(focus_table(statement, statement.lines), ExportFormat.JSONL).splitlines()
    first = json.loads(lines[0])
    assert first["BilledCost"] == "0.001500000" and first["x_Requests"] == 2
    assert first["Tags"]["llmmesh/tenant"] == "acme"
    assert first["ChargeClass"] is None


def test_parquet_money_is_decimal128_and_round_trips_exactly(statement):
    data = encode(focus_table(statement, statement.lines), ExportFormat.PARQUET)
    table = pq.read_table(io.BytesIO(data))
    assert table.schema.field("BilledCost").type == pa.decimal128(38, 9)
    assert table.schema.field("ChargePeriodStart").type == pa.timestamp("ns", tz="UTC")
    assert table.column("BilledCost").to_pylist() == [l.cost for l in statement.lines]


def test_invoice_lines_table(statement):
    rows = rows_of_csv(encode(invoice_table(statement, statement.lines), ExportFormat.CSV))
    assert [(r["token_kind"], r["cost"], r["device_seconds"]) for r in rows] == [
        ("prompt", "0.001500000", "1.500000000"), ("completion", "0.006000000", "6.000000000"),
        ("idle", "3.592500000", "3592.500000000")]


def test_cloudevents_one_per_request_with_its_cost():
    record = UsageRecord("req-1", "acme", "m", "batch", 100, 40, 50, 1.5, 6.0, "cpu", "w0",
                         ("stop",), HOUR0 * H + 5 * S)
    data, count = cloudevents.to_jsonl([record], BOOK)
    (event,) = [json.loads(line) for line in data.splitlines()]
    assert count == 1
    assert {k: event[k] for k in ("specversion", "id", "type", "subject", "time")} == {
        "specversion": "1.0", "id": "req-1", "type": "dev.llmmesh.usage.v1",
        "subject": "acme", "time": "2024-10-04T00:00:05Z"}
    assert (event["data"]["prompt_cost"], event["data"]["cost"]) == ("0.001500000",
                                                                     "0.007500000")
