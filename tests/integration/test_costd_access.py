"""Authorized cost reads on a real costd (mutual TLS, the golden spans billed): a tenant's API
key reads its own usage, invoices and exports and nothing else; the admin key reads the fleet;
no key, a malformed one or a revoked one is UNAUTHENTICATED.
"""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys

import grpc
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from costd_proc import GOLDEN, REPO, export_by_sender, start_costd, stop
from llmmesh.apikeys import hash_key
from llmmesh.cli_cost import profile_proto
from llmmesh.v1 import cost_pb2, cost_pb2_grpc

pytestmark = pytest.mark.timeout(60)
T0 = 1735689600  # the golden spans' hour: 2025-01-01T00:00:00Z
RANGE = dict(start_unix_s=T0, end_unix_s=T0 + 7200)
KEYS = {"admin": ["test-admin"], "acme": ["test-acme", "test-acme-old"], "globex": ["test-globex"]}


def write_keys(path, keys: dict[str, list[str]]) -> None:
    def digests(name):
        return ", ".join(f'"{hash_key(k)}"' for k in keys.get(name, []))
    path.write_text(f"[admin]\napi_key_sha256 = [{digests('admin')}]\n"
                    f"[tenants.acme]\napi_key_sha256 = [{digests('acme')}]\n"
                    f"[tenants.globex]\napi_key_sha256 = [{digests('globex')}]\n")
    # A rewrite inside one mtime tick would look unchanged to the watcher.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


@pytest.fixture(scope="module")
def costd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("access")
    tenants = tmp / "tenants.toml"
    write_keys(tenants, KEYS)
    server = start_costd(str(tmp / "ledger.sqlite"), tmp / "costd.log",
                         "--prices", str(GOLDEN / "prices.toml"), "--tenants", str(tenants),
                         "--curves-dir", str(GOLDEN / "curves"))
    request = json_format.Parse((GOLDEN / "spans.json").read_text(),
                                trace_service_pb2.ExportTraceServiceRequest())
    export_by_sender(server, request)
    server.tenants = tenants
    yield server
    stop(server)


def auth(key: str | None):
    return () if key is None else (("authorization", f"Bearer {key}"),)


def call(costd, method: str, key: str | None, tenant: str = "", **export):
    """One CostService read with `key`: the response (for an export, its bytes)."""
    query = cost_pb2.BillingQuery(tenant_id=tenant, **RANGE)
    with costd.channel(api_key=None) as channel:
        stub = cost_pb2_grpc.CostServiceStub(channel)
        if method == "GetUsage":
            return stub.GetUsage(cost_pb2.GetUsageRequest(tenant_id=tenant, **RANGE),
                                 metadata=auth(key), timeout=10)
        if method == "GetInvoice":
            return stub.GetInvoice(cost_pb2.GetInvoiceRequest(query=query),
                                   metadata=auth(key), timeout=10)
        request = cost_pb2.ExportBillingRequest(query=query, **export)
        chunks = list(stub.ExportBilling(request, metadata=auth(key), timeout=10))
        assert chunks[-1].HasField("summary")
        return b"".join(c.data for c in chunks[:-1])


def refusal(costd, method: str, key: str | None, tenant: str = "") -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(costd, method, key, tenant)
    return caught.value


READS = ("GetUsage", "GetInvoice", "ExportBilling")


def test_a_tenant_key_reads_its_own_usage_invoice_and_exports(costd):
    usage = call(costd, "GetUsage", "test-acme", "acme")
    assert usage.tenant_id == "acme" and usage.requests > 0
    invoice = call(costd, "GetInvoice", "test-acme", "acme")
    assert [i.tenant_id for i in invoice.invoices] == ["acme"]
    assert invoice.invoices[0].requests == usage.requests
    assert not invoice.HasField("reconciliation") and not invoice.warnings
    focus = call(costd, "ExportBilling", "test-acme", "acme", schema=cost_pb2.EXPORT_SCHEMA_FOCUS)
    rows = list(csv.DictReader(io.StringIO(focus.decode())))
    assert rows and {r["x_TenantId"] for r in rows} == {"acme"}
    events = call(costd, "ExportBilling", "test-acme", "acme",
                  schema=cost_pb2.EXPORT_SCHEMA_CLOUDEVENTS)
    subjects = {json.loads(line)["subject"] for line in events.decode().splitlines()}
    assert subjects == {"acme"}


@pytest.mark.parametrize("method", READS)
def test_another_tenants_reads_are_denied_alike_whether_it_exists_or_not(costd, method):
    assert call(costd, method, "test-globex", "globex")       # its own key: answered
    real = refusal(costd, method, "test-acme", "globex")
    made_up = refusal(costd, method, "test-acme", "nobody")
    assert real.code() == made_up.code() == grpc.StatusCode.PERMISSION_DENIED
    assert real.details() == made_up.details()
    assert "globex" not in real.details()


@pytest.mark.parametrize("method", READS)
def test_the_fleet_is_denied_to_a_tenant_key_and_answered_for_the_admin_key(costd, method):
    denied = refusal(costd, method, "test-acme", "")
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "admin credential" in denied.details()
    if method == "GetUsage":   # usage is per tenant: the admin names one, any one
        assert call(costd, method, "test-admin", "globex").requests > 0
        assert refusal(costd, method, "test-admin", "").code() == grpc.StatusCode.INVALID_ARGUMENT
        return
    answer = call(costd, method, "test-admin", "")
    if method == "GetInvoice":
        assert {i.tenant_id for i in answer.invoices} >= {"acme", "globex"}
        assert answer.reconciliation.capacity_cost
    else:
        assert {r["x_TenantId"] for r in csv.DictReader(io.StringIO(answer.decode()))} >= {"acme", "globex"}


@pytest.mark.parametrize("method", READS)
@pytest.mark.parametrize("key", [None, "garbage", "", hash_key("test-admin")])
def test_no_garbage_or_digest_keys_are_unauthenticated(costd, method, key):
    for tenant in ("acme", ""):
        assert refusal(costd, method, key, tenant).code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_malformed_authorization_header_is_unauthenticated(costd):
    with costd.channel(api_key=None) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            cost_pb2_grpc.CostServiceStub(channel).GetUsage(
                cost_pb2.GetUsageRequest(tenant_id="acme"),
                metadata=(("authorization", "Basic test-acme"),), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_whatif_answers_any_key_and_refuses_no_key(costd):
    request = cost_pb2.WhatIfRequest(profile=profile_proto(str(GOLDEN / "whatif_profile.json")),
                                     scenario=cost_pb2.Scenario(device="a100"))
    with costd.channel(api_key=None) as channel:
        stub = cost_pb2_grpc.CostServiceStub(channel)
        for key in ("test-acme", "test-admin"):
            assert stub.WhatIf(request, metadata=auth(key), timeout=10).cost_per_million_tokens
        with pytest.raises(grpc.RpcError) as caught:
            stub.WhatIf(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_revoked_key_is_unauthenticated_after_reload_and_a_bad_edit_changes_nothing(costd):
    assert call(costd, "GetUsage", "test-acme-old", "acme").requests > 0
    try:
        write_keys(costd.tenants, {**KEYS, "acme": ["test-acme"]})
        assert refusal(costd, "GetUsage", "test-acme-old", "acme").code() == \
            grpc.StatusCode.UNAUTHENTICATED
        assert call(costd, "GetUsage", "test-acme", "acme").requests > 0
        costd.tenants.write_text("[admin\n")                     # a half-saved edit
        stat = costd.tenants.stat()
        os.utime(costd.tenants, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
        assert call(costd, "GetUsage", "test-acme", "acme").requests > 0   # last good file
        assert refusal(costd, "GetUsage", "test-acme-old", "acme").code() == \
            grpc.StatusCode.UNAUTHENTICATED
        assert "not reloaded, keeping the last good one" in costd.log()
    finally:
        write_keys(costd.tenants, KEYS)


def test_a_bad_tenants_file_stops_costd_at_start_with_one_line(tmp_path):
    bad = tmp_path / "tenants.toml"
    bad.write_text('[admin]\napi_key_sha256 = ["not-a-digest"]\n')
    done = subprocess.run([sys.executable, "-m", "costd", "--listen", "127.0.0.1:0",
                           "--db", str(tmp_path / "ledger.sqlite"), "--tenants", str(bad)],
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert f"{bad}:2: admin.api_key_sha256: entries must be SHA-256" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def bill(costd, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """`llmmesh bill` with only the keys in `env` (none inherited, none on argv)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLMMESH_ADMIN_KEY")
            and k != "LLMMESH_API_KEY"}
    return subprocess.run([sys.executable, "-m", "llmmesh.cli", "bill", "--costd", costd.address,
                           "--from", "2025-01-01", "--to", "2025-01-01T02:00:00Z", *args],
                          cwd=costd.tenants.parent, env={**base, **env}, capture_output=True,
                          text=True, timeout=60)


def test_llmmesh_bill_sends_a_tenants_own_key_for_its_bill_and_the_admin_key_for_the_fleet(costd):
    own = bill(costd, {"LLMMESH_API_KEY": "test-acme"}, "--tenant", "acme")
    assert own.returncode == 0, own.stderr
    assert "tenant acme: amount due" in own.stdout and "fleet:" not in own.stdout
    other = bill(costd, {"LLMMESH_API_KEY": "test-acme"}, "--tenant", "globex")
    assert other.returncode == 1 and "PERMISSION_DENIED" in other.stderr
    # A tenant's key is never used for the fleet: without the admin key there is nothing to send.
    fleet = bill(costd, {"LLMMESH_API_KEY": "test-acme"})
    assert fleet.returncode == 2 and "LLMMESH_ADMIN_KEY" in fleet.stderr
    admin = bill(costd, {"LLMMESH_ADMIN_KEY": "test-admin"})
    assert admin.returncode == 0, admin.stderr
    assert "fleet: capacity" in admin.stdout and "tenant globex" in admin.stdout


def test_llmmesh_bill_reads_the_admin_key_from_an_owner_only_file(costd, tmp_path):
    key_file = tmp_path / "admin.key"
    key_file.write_text("test-admin\n")
    key_file.chmod(0o600)
    done = bill(costd, {"LLMMESH_ADMIN_KEY_FILE": str(key_file)})
    assert done.returncode == 0, done.stderr
    assert "fleet: capacity" in done.stdout
    key_file.chmod(0o644)
    shared = bill(costd, {"LLMMESH_ADMIN_KEY_FILE": str(key_file)})
    assert shared.returncode == 2 and "chmod 600" in shared.stderr
