"""costd on PostgreSQL (the machine's server; skipped when unreachable): the golden spans give
the very same invoice as on SQLite, retried exports land once, and a restart keeps everything."""
from __future__ import annotations

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from costd_proc import GOLDEN, export_by_sender, start_costd, stop
from pg_ledger import postgres_url_or_skip
from test_costd_golden import RANGE, as_json
from llmmesh.v1 import cost_pb2, cost_pb2_grpc

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def postgres_url():
    yield from postgres_url_or_skip()


def test_golden_bill_on_postgresql_survives_a_restart(postgres_url, tmp_path):
    request = json_format.Parse((GOLDEN / "spans.json").read_text(),
                                trace_service_pb2.ExportTraceServiceRequest())
    query = cost_pb2.GetInvoiceRequest(query=cost_pb2.BillingQuery(**RANGE))
    prices = ("--prices", str(GOLDEN / "prices.toml"))
    first = start_costd(postgres_url, tmp_path / "costd.log", *prices)
    try:
        for _ in range(2):
            assert export_by_sender(first, request).partial_success.rejected_spans == 1
    finally:
        stop(first)
    second = start_costd(postgres_url, tmp_path / "costd.log", *prices)
    try:
        with second.channel() as channel:
            response = cost_pb2_grpc.CostServiceStub(channel).GetInvoice(query, timeout=10)
    finally:
        stop(second)
    assert as_json(response) == (GOLDEN / "invoice_unused.json").read_bytes()
