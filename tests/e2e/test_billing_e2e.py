"""Billing on the real mesh: every tenant's bill matches what its clients were told, and the
tenants' costs plus idle capacity equal the fleet's device-hours times the price, to the cent."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import tomllib
from decimal import Decimal

import pytest

from llmmesh.launcher import REPO_ROOT, Mesh
from llmmesh.v1 import gateway_pb2, gateway_pb2_grpc
from tests.e2e.meshkit import DEMO_KEYS, auth, chat

import grpc

pytestmark = [pytest.mark.e2e, pytest.mark.model]


def _bill(mesh: Mesh, *args: str) -> dict:
    # The admin key file the launcher wrote, as after `make up`.
    env = {**os.environ, "LLMMESH_ADMIN_KEY_FILE": mesh.admin_key_path}
    env.pop("LLMMESH_ADMIN_KEY", None)
    out = subprocess.run([sys.executable, "-m", "llmmesh.cli", "bill", "--costd",
                          mesh.procs["costd"].address, "--format", "json", *args],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env=env,
                         check=True).stdout
    return json.loads(out)


def _cpu_price() -> Decimal:
    with open(os.path.join(REPO_ROOT, "config", "prices.toml"), "rb") as f:
        book = tomllib.load(f, parse_float=Decimal)
    return Decimal(str(book["devices"]["cpu"]["prices"][-1]["per_hour"]))


def test_bills_match_clients_and_reconcile_to_device_hours(tmp_path):
    mesh = Mesh(var_dir=str(tmp_path), worker_args=["--max-num-seqs", "4"])
    told: dict[str, list] = {"acme": [], "globex": []}
    try:
        asyncio.run(mesh.up(num_workers=1, timeout_s=240))
        with grpc.insecure_channel(mesh.procs["gateway"].address) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            for tenant, text in (("acme", "Name a fruit."), ("acme", "Name a planet."),
                                 ("globex", "Name a river.")):
                done = stub.Complete(gateway_pb2.CompleteRequest(request=chat(text, 8)),
                                     metadata=auth(DEMO_KEYS[tenant]), timeout=120)
                told[tenant].append(done.final.usage)
        # SIGTERM makes the worker report its last, partial capacity interval.
        assert mesh.stop_one("worker0") == 0
        time.sleep(1.5)
        for tenant, usages in told.items():
            inv = _bill(mesh, "--tenant", tenant)["invoices"][0]
            assert int(inv["requests"]) == len(usages)
            assert int(inv["promptTokens"]) == sum(u.prompt_tokens for u in usages)
            assert int(inv["completionTokens"]) == sum(u.completion_tokens for u in usages)
        fleet = _bill(mesh)["reconciliation"]
        assert Decimal(fleet["capacityDue"]) == Decimal(fleet["tenantsDue"]) + Decimal(fleet["unusedDue"])
        uptime_h = Decimal(sum(int(w["uptimeNs"]) for w in fleet["workers"])) / Decimal(3.6e12)
        assert uptime_h > 0
        # At $0.10/h a test-length run costs well under a cent, so check to 1e-9, not just cents.
        expected = uptime_h * _cpu_price()
        assert abs(Decimal(fleet["capacityCost"]) - expected) <= Decimal("1e-9")
        assert Decimal(fleet["capacityCost"]) == Decimal(fleet["tenantsCost"]) + Decimal(fleet["unusedCost"])
        assert 0 < Decimal(fleet["tenantsCost"]) < Decimal(fleet["capacityCost"])
    finally:
        mesh.down()
