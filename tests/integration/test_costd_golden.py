"""Golden: OTLP spans in (tests/golden/costd/spans.json) → invoices and FOCUS rows out, exact.

The bill is checkable by hand (tests/golden/costd/prices.toml: cpu $0.001/s, a100 $4/h):
acme = 1.5 + 6 cpu-s + 36 + 360 a100-s = $0.0015 + $0.006 + $0.04 + $0.40 = $0.4475 → $0.45;
globex = 0.314 + 0.556 cpu-s + 7.2 + 72 a100-s = $0.08887 → $0.09; capacity = 5,400 cpu-s +
7,200 a100-s = $5.40 + $8.00 = $13.40 = tenants + unused, where unused holds the 360 a100-s
w-gpu spent loading models ($0.40, a line of its own). Set LLMMESH_UPDATE_GOLDEN=1 to
rewrite the expected files after an intended change (then review the diff).
"""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from decimal import Decimal

import pyarrow.parquet as pq
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from costd_proc import GOLDEN, REPO, export_by_sender, start_costd, stop
from llmmesh.apikeys import ADMIN_KEY_ENV, DEMO_ADMIN_KEY
from llmmesh.v1 import cost_pb2, cost_pb2_grpc

pytestmark = pytest.mark.timeout(60)
T0 = 1735689600  # 2025-01-01T00:00:00Z
RANGE = dict(start_unix_s=T0, end_unix_s=T0 + 7200)
UPDATE = os.environ.get("LLMMESH_UPDATE_GOLDEN") == "1"


def golden(name: str, actual: bytes) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_bytes(actual)
    assert actual == path.read_bytes(), f"{name} differs from the golden file"


@pytest.fixture(scope="module")
def costd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("golden")
    server = start_costd(str(tmp / "ledger.sqlite"), tmp / "costd.log",
                         "--prices", str(GOLDEN / "prices.toml"))
    request = json_format.Parse((GOLDEN / "spans.json").read_text(),
                                trace_service_pb2.ExportTraceServiceRequest())
    answers = [export_by_sender(server, request) for _ in range(2)]  # a retried export
    server.answers = answers
    yield server
    stop(server)


def invoice(costd, **query) -> cost_pb2.GetInvoiceResponse:
    with costd.channel() as channel:
        return cost_pb2_grpc.CostServiceStub(channel).GetInvoice(
            cost_pb2.GetInvoiceRequest(query=cost_pb2.BillingQuery(**RANGE, **query)), timeout=10)


def export(costd, schema, fmt, **query) -> bytes:
    request = cost_pb2.ExportBillingRequest(query=cost_pb2.BillingQuery(**RANGE, **query),
                                            schema=schema, format=fmt)
    with costd.channel() as channel:
        chunks = list(cost_pb2_grpc.CostServiceStub(channel).ExportBilling(request, timeout=10))
    assert chunks[-1].HasField("summary")
    return b"".join(c.data for c in chunks[:-1])


def as_json(message) -> bytes:
    return (json.dumps(json_format.MessageToDict(message), indent=1, sort_keys=True)
            + "\n").encode()


def test_malformed_span_is_reported_each_time_and_the_rest_lands(costd):
    for answer in costd.answers:
        assert answer.partial_success.rejected_spans == 1
        assert "llmmesh.tenant.id is required" in answer.partial_success.error_message


def test_fleet_invoice_is_golden_and_adds_up_by_hand(costd):
    response = invoice(costd)
    golden("invoice_unused.json", as_json(response))
    due = {i.tenant_id: i.amount_due for i in response.invoices}
    assert due == {"acme": "0.45", "globex": "0.09", "initech": "0.00"}
    acme = next(i for i in response.invoices if i.tenant_id == "acme")
    assert (acme.total, acme.requests, acme.prompt_tokens, acme.completion_tokens) == (
        "0.447500000", 3, 10120, 5050)
    r = response.reconciliation
    assert (r.capacity_cost, r.tenants_cost, r.unused_cost) == (
        "13.400000000", "0.536370000", "12.863630000")
    assert (r.capacity_due, r.tenants_due, r.unused_due) == ("13.40", "0.54", "12.86")
    assert {(w.worker_id, w.uptime_ns) for w in r.workers} == {("w-cpu", 5400 * 10**9),
                                                              ("w-gpu", 7200 * 10**9)}
    assert any("'cuda:Tesla-T4' is not in the price book" in w for w in response.warnings)
    a100 = next(d for d in r.devices if d.device == "a100")
    assert (a100.loading_ns, a100.loading_cost) == (360 * 10**9, "0.400000000")
    assert a100.idle_ns == a100.capacity_ns - a100.attributed_ns - a100.loading_ns
    assert all(i.loading_cost == "0" for i in response.invoices)   # nobody's under "unused"


def test_pro_rata_invoice_is_golden_and_bills_all_capacity(costd):
    response = invoice(costd, idle_policy=cost_pb2.IDLE_POLICY_PRO_RATA)
    golden("invoice_pro_rata.json", as_json(response))
    r = response.reconciliation
    assert Decimal(r.tenants_cost) + Decimal(r.unused_cost) == Decimal(r.capacity_cost)
    assert Decimal(r.unused_cost) == 0  # every period with capacity had a tenant
    # Loading is shared like idle: the tenants' shares add up to its $0.40.
    assert sum(Decimal(i.loading_cost) for i in response.invoices) == Decimal("0.4")


def test_one_tenant_sees_only_its_own_invoice(costd):
    response = invoice(costd, tenant_id="globex")
    assert [i.tenant_id for i in response.invoices] == ["globex"]
    assert not response.HasField("reconciliation")
    assert invoice(costd, tenant_id="nobody").invoices[0].total == "0"


def test_focus_export_is_golden(costd):
    data = export(costd, cost_pb2.EXPORT_SCHEMA_FOCUS, cost_pb2.EXPORT_FORMAT_CSV,
                  granularity=cost_pb2.GRANULARITY_HOUR)
    golden("focus_hourly.csv", data)
    rows = list(csv.DictReader(io.StringIO(data.decode())))
    assert sum(Decimal(r["BilledCost"]) for r in rows) == Decimal("13.4")


def test_cloudevents_export_is_golden(costd):
    data = export(costd, cost_pb2.EXPORT_SCHEMA_CLOUDEVENTS, cost_pb2.EXPORT_FORMAT_JSONL)
    golden("usage_events.jsonl", data)
    assert len(data.splitlines()) == 6  # one per billed request, the repeat export deduped


def llmmesh(*args: str) -> subprocess.CompletedProcess:
    """The CLI as an operator runs it: the admin key in the environment."""
    return subprocess.run([sys.executable, "-m", "llmmesh.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, ADMIN_KEY_ENV: DEMO_ADMIN_KEY})


def test_llmmesh_bill_matches_the_api(costd, tmp_path):
    window = ["--costd", costd.address, "--from", "2025-01-01T00:00:00Z",
              "--to", "2025-01-01T02:00:00Z"]
    shown = llmmesh("bill", *window, "--tenant", "acme")
    assert shown.returncode == 0, shown.stderr
    assert "tenant acme: amount due 0.45 USD" in shown.stdout
    as_json_out = llmmesh("bill", *window, "--format", "json")
    assert json.loads(as_json_out.stdout) == json_format.MessageToDict(invoice(costd))
    out = tmp_path / "focus.csv"
    assert llmmesh("bill", *window, "--format", "focus", "--granularity", "hour", "--out",
                   str(out)).returncode == 0
    assert out.read_bytes() == (GOLDEN / "focus_hourly.csv").read_bytes()
    parquet = tmp_path / "acme.parquet"
    assert llmmesh("bill", *window, "--tenant", "acme", "--format", "parquet", "--out",
                   str(parquet)).returncode == 0
    costs = pq.read_table(parquet).column("cost").to_pylist()
    assert sum(costs) == Decimal("0.4475")
