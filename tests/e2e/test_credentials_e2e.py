"""S1 on the real mesh: 1,000 generated bad credentials — missing, malformed, unknown, revoked
(its tenant removed from the file), rotated out (an old key after the new one replaced it), and
another tenant's key — on the gateway's GetBatch / CancelBatch / StreamBatchResults / Generate
and costd's GetUsage / GetInvoice: every one UNAUTHENTICATED, PERMISSION_DENIED or NOT_FOUND,
none processed (the job stays as it was), none leaking the owner (no message names it). The
owner's current key, as the control, reads its job and its usage."""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import random
import string
import time
from collections import Counter

import grpc
import pytest

from llmmesh import mtls
from llmmesh.apikeys import DEMO_ADMIN_KEY
from llmmesh.identity import Role
from llmmesh.launcher import Mesh
from llmmesh.v1 import common_pb2, cost_pb2, cost_pb2_grpc, gateway_pb2, gateway_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.model]
NUM_CREDENTIALS = int(os.environ.get("LLMMESH_S1_CREDENTIALS", "1000"))
KEYS = {"acme-old": "s1-acme-old-key", "acme": "s1-acme-current-key", "globex": "s1-globex-key",
        "initech": "s1-initech-key"}


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _tenants(acme_keys: list[str], with_initech: bool) -> str:
    toml = f'[admin]\napi_key_sha256 = ["{_digest(DEMO_ADMIN_KEY)}"]\n\n'
    toml += "[tenants.acme]\napi_key_sha256 = [" + ", ".join(f'"{_digest(k)}"' for k in acme_keys)
    toml += ']\ncache_scope = "acme"\n\n'
    toml += f'[tenants.globex]\napi_key_sha256 = ["{_digest(KEYS["globex"])}"]\ncache_scope = "globex"\n'
    if with_initech:
        toml += f'\n[tenants.initech]\napi_key_sha256 = ["{_digest(KEYS["initech"])}"]\n'
    return toml


def _rewrite(path, text: str) -> None:
    path.write_text(text)
    stat = os.stat(path)   # a new mtime for certain, however fast the edit came
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))


@pytest.fixture(scope="module")
def s1_mesh(tmp_path_factory):
    """No worker: a batch job stays queued, so whether any bad call touched it shows."""
    var = tmp_path_factory.mktemp("s1")
    tenants = var / "tenants.toml"
    tenants.write_text(_tenants([KEYS["acme-old"], KEYS["acme"]], with_initech=True))
    m = Mesh(var_dir=str(var), gateway_args=["--tenants", str(tenants)])
    try:
        asyncio.run(m.up(num_workers=0, timeout_s=120))
        yield m, tenants
    finally:
        m.down()


def _bad_credentials(rng: random.Random, calls) -> tuple[str, str, tuple]:
    """(kind, call, metadata), cycling through every kind of bad credential on every call."""
    def junk(n):
        return "".join(rng.choice(string.ascii_letters + string.digits + "-_.") for _ in range(n))
    kinds = {
        "missing": lambda: (),
        "empty bearer": lambda: (("authorization", "Bearer "),),
        "not bearer": lambda: (("authorization", f"Basic {junk(20)}"),),
        "bare key": lambda: (("authorization", KEYS["acme"]),),
        "garbled": lambda: (("authorization", f"Bearer {junk(rng.randint(1, 64))}"),),
        # Long, but under gRPC's metadata limit: the key check refuses it, not the transport.
        "oversize": lambda: (("authorization", f"Bearer {junk(4000)}"),),
        "near miss": lambda: (("authorization", f"Bearer {KEYS['acme'][:-1]}{rng.choice('abc')}"),),
        "revoked": lambda: (("authorization", f"Bearer {KEYS['initech']}"),),
        "rotated out": lambda: (("authorization", f"Bearer {KEYS['acme-old']}"),),
        "another tenant's": lambda: (("authorization", f"Bearer {KEYS['globex']}"),),
    }
    for kind, call in itertools.cycle(itertools.product(kinds, calls)):
        yield kind, call, kinds[kind]()


def test_a_thousand_bad_credentials_are_refused_and_touch_nothing(s1_mesh):
    mesh, tenants = s1_mesh
    gw_channel = grpc.insecure_channel(mesh.procs["gateway"].address)
    gateway = gateway_pb2_grpc.GatewayServiceStub(gw_channel)
    owner = (("authorization", f"Bearer {KEYS['acme']}"),)
    item = gateway_pb2.GenerateRequest(prompt="Hello", sampling=common_pb2.SamplingParams(max_tokens=4))
    job = gateway.SubmitBatch(gateway_pb2.SubmitBatchRequest(requests=[item] * 3,
                                                             display_name="s1"),
                              metadata=owner, timeout=30).job
    # Rotation and revocation: acme's old key replaced by its current one, initech removed.
    _rewrite(tenants, _tenants([KEYS["acme"]], with_initech=False))
    time.sleep(0.5)
    cost_channel = mtls.channel(mesh.procs["costd"].address, mesh.identity(Role.ADMIN), Role.COSTD)
    cost = cost_pb2_grpc.CostServiceStub(cost_channel)
    calls = {
        "GetBatch": lambda md: gateway.GetBatch(gateway_pb2.GetBatchRequest(job_id=job.job_id),
                                                metadata=md, timeout=5),
        "CancelBatch": lambda md: gateway.CancelBatch(
            gateway_pb2.CancelBatchRequest(job_id=job.job_id), metadata=md, timeout=5),
        "StreamBatchResults": lambda md: list(gateway.StreamBatchResults(
            gateway_pb2.StreamBatchResultsRequest(job_id=job.job_id), metadata=md, timeout=5)),
        "Generate": lambda md: list(gateway.Generate(item, metadata=md, timeout=5)),
        "GetUsage": lambda md: cost.GetUsage(cost_pb2.GetUsageRequest(tenant_id="acme"),
                                             metadata=md, timeout=5),
        "GetInvoice": lambda md: cost.GetInvoice(cost_pb2.GetInvoiceRequest(
            query=cost_pb2.BillingQuery(tenant_id="acme")), metadata=md, timeout=5),
    }
    refused = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
               grpc.StatusCode.NOT_FOUND}
    table: dict[tuple[str, str], Counter] = {}
    processed, leaked, latencies = [], [], []
    credentials = _bad_credentials(random.Random(1), calls)
    sent = 0
    while sent < NUM_CREDENTIALS:
        kind, name, md = next(credentials)
        if kind == "another tenant's" and name == "Generate":
            continue   # its own Generate is its right; the other calls target acme's job and bills
        started = time.perf_counter()
        try:
            calls[name](md)
            processed.append((kind, name))
            code, details = "OK", ""
        except grpc.RpcError as exc:
            code, details = exc.code().name, exc.details() or ""
            if exc.code() not in refused:
                processed.append((kind, name, code, details))
            if "acme" in details or job.display_name in details:
                leaked.append((kind, name, details))
        latencies.append(time.perf_counter() - started)
        table.setdefault((kind, name), Counter())[code] += 1
        sent += 1
    print(f"\n  {sent} bad credentials:")
    for (kind, name), counts in sorted(table.items()):
        print(f"    {kind:17} {name:19} {dict(counts)}")
    latencies.sort()
    print(f"  refusal p50 {latencies[len(latencies) // 2] * 1000:.1f} ms, "
          f"p99 {latencies[int(len(latencies) * 0.99)] * 1000:.1f} ms")
    assert processed == [] and leaked == []
    # Unauthenticated kinds are UNAUTHENTICATED wherever they go; another tenant's key never
    # learns that the job exists (NOT_FOUND) and is denied acme's bills.
    for (kind, name), counts in table.items():
        if kind == "another tenant's":
            expected = "PERMISSION_DENIED" if name in ("GetUsage", "GetInvoice") else "NOT_FOUND"
        else:
            expected = "UNAUTHENTICATED"
        assert set(counts) == {expected}, (kind, name, counts)
    # Nothing was processed: the job is as it was, and the owner still reads it and its usage.
    after = gateway.GetBatch(gateway_pb2.GetBatchRequest(job_id=job.job_id), metadata=owner, timeout=5)
    assert after.status == job.status and after.num_requests == 3
    assert after.status != gateway_pb2.BATCH_STATUS_CANCELLED
    cost.GetUsage(cost_pb2.GetUsageRequest(tenant_id="acme"), metadata=owner, timeout=5)
    gw_channel.close()
    cost_channel.close()
