"""What a run cost: costd's invoices for the mesh, the price book for everything else.

costd bills a request by the device time the worker attributed to it (prompt and completion
apart) at the price book's rate; the fleet's capacity cost adds idle time. For the worker alone
and llama-server there is no billing path, so the bench prices their device time (worker) or
wall time (any target, the "dedicated machine" cost) with the same price book.
"""
from __future__ import annotations

import asyncio
import fnmatch
import time
import tomllib
from pathlib import Path

import grpc

from llmmesh import mtls
from llmmesh.apikeys import DEMO_ADMIN_KEY, read_admin_key
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity
from llmmesh.v1 import cost_pb2, cost_pb2_grpc

PRICES_PATH = Path(__file__).resolve().parent.parent / "config" / "prices.toml"


def price_per_hour(device_type: str = "cpu", path: Path = PRICES_PATH) -> tuple[float, str, str]:
    """(price per device-hour now, currency, price-book device) for a worker's device type."""
    book = tomllib.loads(path.read_text())
    device = next((name for pattern, name in book.get("aliases", {}).items()
                   if fnmatch.fnmatchcase(device_type, pattern)), device_type)
    entries = book.get("devices", {}).get(device, {}).get("prices", [])
    now = time.time()
    current = [e for e in entries if e["from"].timestamp() <= now]
    if not current:
        raise KeyError(f"no price for device {device!r} in {path}")
    return float(current[-1]["per_hour"]), book.get("currency", "USD"), device


async def costd_bill(address: str, identity: MeshIdentity, start_unix_s: float, end_unix_s: float, num_requests: int,
                     timeout_s: float = 30.0) -> dict | None:
    """Invoices over [start, end) once costd has every request (spans arrive in batches)."""
    query = cost_pb2.BillingQuery(start_unix_s=start_unix_s, end_unix_s=end_unix_s,
                                  granularity=cost_pb2.GRANULARITY_TOTAL)
    # Every tenant's invoices: the admin key (the bench's mesh reads config/tenants.toml).
    metadata = (("authorization", f"Bearer {read_admin_key() or DEMO_ADMIN_KEY}"),)
    deadline = time.monotonic() + timeout_s
    async with mtls.aio_channel(address, identity, Role.COSTD) as channel:
        stub = cost_pb2_grpc.CostServiceStub(channel)
        while True:
            try:
                resp = await stub.GetInvoice(cost_pb2.GetInvoiceRequest(query=query),
                                            metadata=metadata, timeout=10)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return None  # an older costd: the caller prices device seconds itself
                raise
            billed = sum(inv.requests for inv in resp.invoices)
            if billed >= num_requests or time.monotonic() > deadline:
                return _bill(resp, billed, num_requests)
            await asyncio.sleep(0.5)


def _bill(resp: cost_pb2.GetInvoiceResponse, billed: int, expected: int) -> dict:
    tenants = {inv.tenant_id: {"cost": float(inv.total), "requests": inv.requests,
                               "tokens": inv.prompt_tokens + inv.completion_tokens}
               for inv in resp.invoices}
    capacity = resp.reconciliation.capacity_cost if resp.HasField("reconciliation") else ""
    return {"currency": resp.currency, "tenants": tenants, "requests_billed": billed,
            "requests_expected": expected, "capacity_cost": float(capacity) if capacity else None,
            "warnings": list(resp.warnings)}


def per_million(cost: float | None, tokens: int) -> float | None:
    return None if cost is None or tokens <= 0 else cost / tokens * 1e6


def level_cost(prompt_tokens: int, completion_tokens: int, wall_s: float,
               device_s: float | None, device_type: str, bill: dict | None) -> dict:
    """Cost per 1M tokens (prompt + completion) of one level, three ways:

    - wall: the machine for the level's wall time, busy or idle (comparable across targets);
    - device: the device seconds the engine attributed to requests (what costd bills by);
    - costd: the mesh's actual invoices (tenants' totals) and the fleet's capacity cost.
    """
    price, currency, device = price_per_hour(device_type)
    tokens = prompt_tokens + completion_tokens
    out = {"device": device, "price_per_hour": price, "currency": currency, "tokens": tokens,
           "wall_per_1m": per_million(wall_s * price / 3600, tokens),
           "device_per_1m": per_million(device_s * price / 3600 if device_s else None, tokens)}
    if bill is not None:
        billed_tokens = sum(t["tokens"] for t in bill["tenants"].values())
        out["costd"] = {
            "per_1m": per_million(sum(t["cost"] for t in bill["tenants"].values()), billed_tokens),
            "capacity_per_1m": per_million(bill["capacity_cost"], billed_tokens),
            "tenants": {k: per_million(t["cost"], t["tokens"]) for k, t in bill["tenants"].items()},
            "requests_billed": bill["requests_billed"],
            "requests_expected": bill["requests_expected"], "warnings": bill["warnings"]}
    return out
