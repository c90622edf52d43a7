"""`llmmesh bill`, `llmmesh whatif` and `llmmesh whatif-consolidate`: costd's invoices,
exports and what-if answers.

Talks to costd over gRPC only (no service is imported here); `--local` runs
`python -m costd.whatif` on the price book and curves in this checkout instead.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import grpc
import typer
from google.protobuf import json_format

from llmmesh.apikeys import ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, read_admin_key
from llmmesh.atomic_file import write_atomic
from llmmesh.identity import Role
from llmmesh.mtls import MissingIdentity, operator_channel
from llmmesh.v1 import cost_pb2, cost_pb2_grpc

DEFAULT_COSTD = "127.0.0.1:50055"
# --format → (schema, file format); None: not an export but GetInvoice.
EXPORTS = {
    "csv": (cost_pb2.EXPORT_SCHEMA_INVOICE_LINES, cost_pb2.EXPORT_FORMAT_CSV),
    "parquet": (cost_pb2.EXPORT_SCHEMA_INVOICE_LINES, cost_pb2.EXPORT_FORMAT_PARQUET),
    "jsonl": (cost_pb2.EXPORT_SCHEMA_INVOICE_LINES, cost_pb2.EXPORT_FORMAT_JSONL),
    "focus": (cost_pb2.EXPORT_SCHEMA_FOCUS, cost_pb2.EXPORT_FORMAT_CSV),
    "cloudevents": (cost_pb2.EXPORT_SCHEMA_CLOUDEVENTS, cost_pb2.EXPORT_FORMAT_JSONL),
}
FORMATS = ("table", "json", *EXPORTS)
GRANULARITIES = {"total": cost_pb2.GRANULARITY_TOTAL, "hour": cost_pb2.GRANULARITY_HOUR,
                 "day": cost_pb2.GRANULARITY_DAY, "month": cost_pb2.GRANULARITY_MONTH}
IDLE = {"unused": cost_pb2.IDLE_POLICY_UNUSED, "pro-rata": cost_pb2.IDLE_POLICY_PRO_RATA,
        "default": cost_pb2.IDLE_POLICY_UNSPECIFIED}


def unix_s(text: str) -> float:
    """ISO 8601 (a date alone is its midnight; no offset means UTC) → Unix seconds; "" → 0."""
    if not text:
        return 0.0
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError as error:
        raise typer.BadParameter(f"not an ISO 8601 date or time: {text!r}") from error
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def costd_channel(address: str) -> grpc.Channel:
    """costd serves mutual TLS only: this tool calls it with the mesh's admin certificate."""
    try:
        return operator_channel(address, Role.COSTD)
    except MissingIdentity as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)


TENANT_KEY_ENV = "LLMMESH_API_KEY"   # the tenant key `llmmesh generate` reads too


def credentials(tenant: str | None) -> tuple[tuple[str, str], ...]:
    """The API key for a cost read, as call metadata. One tenant's bill (`tenant`): that
    tenant's own key (LLMMESH_API_KEY) when set, else the admin key; the fleet's (""): the
    admin key alone; a what-if (None): either. Keys come from the environment or a 0600 file,
    never from argv (which `ps` shows)."""
    key = os.environ.get(TENANT_KEY_ENV, "").strip() if tenant != "" else ""
    try:
        key = key or read_admin_key() or ""
    except ValueError as exc:
        typer.echo(f"error: admin key: {exc}", err=True)
        raise typer.Exit(2)
    if not key:
        own = f", or the tenant's own key in {TENANT_KEY_ENV}" if tenant != "" else ""
        typer.echo(f"error: costd needs an API key: the admin key in {ADMIN_KEY_ENV} or in the "
                   f"0600 file {ADMIN_KEY_FILE_ENV} (default var/admin.key, which `make up` "
                   f"writes){own}", err=True)
        raise typer.Exit(2)
    return (("authorization", f"Bearer {key}"),)


def _fail(error: grpc.RpcError) -> typer.Exit:
    typer.echo(f"error: {error.code().name}: {error.details()}", err=True)
    return typer.Exit(1)


def _write(out: str | None, data: bytes) -> None:
    if out:
        write_atomic(out, [data])
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()


def export_to(stub: cost_pb2_grpc.CostServiceStub, request: cost_pb2.ExportBillingRequest,
              out: str, metadata: tuple = ()) -> cost_pb2.ExportSummary:
    """Streams the export into `out` crash-safe; the file is replaced only if its SHA-256
    matches the summary costd sent last, so an interrupted stream keeps the old file."""
    digest, summary = hashlib.sha256(), cost_pb2.ExportSummary()

    def chunks():
        for message in stub.ExportBilling(request, metadata=metadata, timeout=600):
            if message.HasField("summary"):
                summary.CopyFrom(message.summary)
            else:
                digest.update(message.data)
                yield message.data

    def check() -> None:
        if not summary.sha256:
            raise RuntimeError("the export stream ended without its summary")
        if summary.sha256 != digest.hexdigest():
            raise RuntimeError("the export's SHA-256 does not match costd's")

    write_atomic(out, chunks(), check)
    return summary


def _money(amount: str, currency: str) -> str:
    return f"{amount} {currency}" if amount else "-"


def print_invoices(response: cost_pb2.GetInvoiceResponse) -> None:
    c = response.currency
    for invoice in response.invoices:
        typer.echo(f"tenant {invoice.tenant_id}: amount due {_money(invoice.amount_due, c)} "
                   f"(total {invoice.total}; prompt {invoice.prompt_cost}, completion "
                   f"{invoice.completion_cost}, idle share {invoice.idle_cost})")
        typer.echo(f"  requests={invoice.requests} prompt_tokens={invoice.prompt_tokens} "
                   f"cached={invoice.cached_prompt_tokens} "
                   f"completion_tokens={invoice.completion_tokens}")
        typer.echo(f"  per 1M tokens: prompt {_money(invoice.prompt_cost_per_million_tokens, c)}"
                   f", completion {_money(invoice.completion_cost_per_million_tokens, c)}")
        for line in invoice.lines:
            kind = cost_pb2.TokenKind.Name(line.token_kind).removeprefix("TOKEN_KIND_").lower()
            typer.echo(f"    {line.model or '-':<24} {line.request_class or '-':<12} "
                       f"{line.device:<6} {kind:<10} tokens={line.tokens:<9} "
                       f"device_s={line.device_ns / 1e9:<10.3f} cost={line.cost}")
    if response.HasField("reconciliation"):
        r = response.reconciliation
        typer.echo(f"fleet: capacity {_money(r.capacity_due, c)} = tenants {r.tenants_due} "
                   f"+ unused {r.unused_due}   (exact: {r.capacity_cost} = {r.tenants_cost} "
                   f"+ {r.unused_cost})")
        for d in r.devices:
            typer.echo(f"  {d.device}: up {d.capacity_ns / 3.6e12:.6f} device-h, used "
                       f"{d.attributed_ns / 3.6e12:.6f}, loading models "
                       f"{d.loading_ns / 3.6e12:.6f}, idle {d.idle_ns / 3.6e12:.6f}")
    for warning in response.warnings:
        typer.echo(f"warning: {warning}", err=True)


def bill(tenant: str = typer.Option("", help="tenant id; empty: every tenant + the fleet"),
         costd: str = typer.Option(DEFAULT_COSTD, help="costd address"),
         start: str = typer.Option("", "--from", help="ISO 8601 start (inclusive); empty: the beginning"),
         end: str = typer.Option("", "--to", help="ISO 8601 end (exclusive); empty: now"),
         fmt: str = typer.Option("table", "--format", help=" | ".join(FORMATS)),
         granularity: str = typer.Option("", help="charge periods: total | hour | day | month"),
         idle: str = typer.Option("default", help="idle capacity: unused | pro-rata | default"),
         out: str = typer.Option("", help="write to this file (crash-safe) instead of stdout")) -> None:
    """A tenant's invoice, or every tenant's with the fleet's reconciliation; or an export.

    The fleet's bills need the admin key (LLMMESH_ADMIN_KEY, or the 0600 file
    LLMMESH_ADMIN_KEY_FILE, default var/admin.key); one tenant's take that tenant's own key
    (LLMMESH_API_KEY) instead."""
    if fmt not in FORMATS or idle not in IDLE or (granularity and granularity not in GRANULARITIES):
        raise typer.BadParameter("see --help for --format, --granularity and --idle values")
    query = cost_pb2.BillingQuery(tenant_id=tenant, start_unix_s=unix_s(start),
                                  end_unix_s=unix_s(end), idle_policy=IDLE[idle],
                                  granularity=GRANULARITIES.get(granularity, 0))
    metadata = credentials(tenant)
    with costd_channel(costd) as channel:
        stub = cost_pb2_grpc.CostServiceStub(channel)
        try:
            if fmt in EXPORTS:
                _export(stub, query, fmt, out, metadata)
                return
            response = stub.GetInvoice(cost_pb2.GetInvoiceRequest(query=query),
                                       metadata=metadata, timeout=120)
        except grpc.RpcError as error:
            raise _fail(error)
    if fmt == "json":
        _write(out or None, json_format.MessageToJson(response).encode() + b"\n")
    else:
        print_invoices(response)


def _export(stub, query: cost_pb2.BillingQuery, fmt: str, out: str, metadata: tuple) -> None:
    schema, file_format = EXPORTS[fmt]
    request = cost_pb2.ExportBillingRequest(query=query, schema=schema, format=file_format)
    if out:
        summary = export_to(stub, request, out, metadata)
        typer.echo(f"wrote {out}: {summary.rows} rows, {summary.size_bytes} bytes, "
                   f"sha256 {summary.sha256}", err=True)
        return
    if fmt == "parquet":
        raise typer.BadParameter("Parquet is binary: give --out FILE")
    for message in stub.ExportBilling(request, metadata=metadata, timeout=600):
        if message.HasField("data"):
            sys.stdout.buffer.write(message.data)
    sys.stdout.flush()


def profile_proto(path: str) -> cost_pb2.TrafficProfile:
    """The profile file (JSON; format in costd/whatif/profile.py) as the proto."""
    return profile_of_json(json.loads(Path(path).read_text()))


def profile_of_json(data: dict) -> cost_pb2.TrafficProfile:
    def buckets(value) -> list[cost_pb2.LengthBucket]:
        pairs = [(value, 1.0)] if isinstance(value, (int, float)) else value
        return [cost_pb2.LengthBucket(tokens=int(t), weight=float(w)) for t, w in pairs]

    return cost_pb2.TrafficProfile(
        requests_per_s_by_hour=[float(r) for r in data["requests_per_s_by_hour"]],
        prompt_tokens=buckets(data["prompt_tokens"]),
        completion_tokens=buckets(data["completion_tokens"]),
        prefix_hit_rate=float(data.get("prefix_hit_rate", 0.0)))


def print_whatif(r: cost_pb2.WhatIfResponse) -> None:
    c = r.currency
    typer.echo(f"feasible: {'yes' if r.feasible else 'NO'}")
    for reason in r.reasons:
        typer.echo(f"  - {reason}")
    typer.echo(f"cost per 1M tokens: {_money(r.cost_per_million_tokens, c)} (prompt "
               f"{_money(r.prompt_cost_per_million_tokens, c)}, completion "
               f"{_money(r.completion_cost_per_million_tokens, c)}); at full utilisation "
               f"{_money(r.cost_per_million_tokens_at_full_utilisation, c)}")
    typer.echo(f"devices needed (peak): {r.devices_needed}; device-hours: {r.device_hours:g}; "
               f"utilisation: {r.utilisation:.1%}; cost: {_money(r.cost, c)}")
    typer.echo(f"concurrency {r.concurrency}: {r.tokens_per_s_per_device:,.1f} tok/s per device; "
               f"p95 latency ≈ {r.p95_latency_s:.2f} s; tokens: {r.tokens:,.0f} (curve {r.curve})")


def _whatif_local(request, response, *flags: str):
    done = subprocess.run([sys.executable, "-m", "costd.whatif", *flags], capture_output=True,
                          input=json_format.MessageToJson(request).encode(),
                          cwd=Path(__file__).resolve().parents[1], env=os.environ.copy())
    if done.returncode != 0:
        typer.echo(done.stderr.decode().strip(), err=True)
        raise typer.Exit(1)
    return json_format.Parse(done.stdout, response)


def _ask_whatif(method: str, request, response, costd: str, local: bool, *local_flags: str):
    """A what-if answered by costd over gRPC (`method` of CostService), or with `local` by
    `python -m costd.whatif` on this checkout's price book and curves."""
    if local:
        return _whatif_local(request, response, *local_flags)
    metadata = credentials(None)
    with costd_channel(costd) as channel:
        try:
            return getattr(cost_pb2_grpc.CostServiceStub(channel), method)(
                request, metadata=metadata, timeout=60)
        except grpc.RpcError as error:
            raise _fail(error)


def whatif(profile: str = typer.Option(..., help="traffic profile JSON file"),
           device: str = typer.Option(..., help="device: a100, h100, h200, cpu, or a device type"),
           costd: str = typer.Option(DEFAULT_COSTD, help="costd address"),
           local: bool = typer.Option(False, "--local", help="answer here, without costd"),
           price_per_hour: str = typer.Option("", help="decimal $/hour; empty: the price book's"),
           quantization: str = typer.Option("", help="pick the curve of this quantization"),
           max_batch: int = typer.Option(0, help="largest batch per device; 0: the curve's"),
           prompt_change_pct: float = typer.Option(0.0, help="prompt length change, % (-20: shorter)"),
           max_devices: int = typer.Option(0, help="devices available; 0: no limit"),
           target_utilisation: float = typer.Option(1.0, help="planned busy share, (0, 1]"),
           autoscale: bool = typer.Option(False, help="devices follow each hour's demand"),
           p95_slo_s: float = typer.Option(0.0, help="p95 latency target, s; 0: none"),
           curve: str = typer.Option("", help="throughput curve JSON; empty: costd's curves"),
           as_json: bool = typer.Option(False, "--json", help="print the answer as JSON")) -> None:
    """What a traffic profile would cost on a device: $/1M tokens, devices, utilisation, p95."""
    request = cost_pb2.WhatIfRequest(
        profile=profile_proto(profile),
        scenario=cost_pb2.Scenario(
            device=device, price_per_hour=price_per_hour, quantization=quantization,
            max_batch=max_batch, prompt_length_change_pct=prompt_change_pct,
            max_devices=max_devices, target_utilisation=target_utilisation,
            autoscale=autoscale, p95_latency_slo_s=p95_slo_s),
        curve_json=Path(curve).read_text() if curve else "")
    response = _ask_whatif("WhatIf", request, cost_pb2.WhatIfResponse(), costd, local)
    if as_json:
        typer.echo(json_format.MessageToJson(response))
    else:
        print_whatif(response)


def models_request(path: str, scenario: cost_pb2.Scenario,
                   device_memory_mib: float) -> cost_pb2.ConsolidationRequest:
    """The models file (JSON; format in costd/whatif/consolidation.py) as the request."""
    data = json.loads(Path(path).read_text())
    try:
        models = [cost_pb2.ConsolidationModel(
            name=str(m["name"]), profile=profile_of_json(m["profile"]),
            curve=m["curve"] if isinstance(m["curve"], str) else "",
            curve_json="" if isinstance(m["curve"], str) else json.dumps(m["curve"]),
            memory_mib=float(m["memory_mib"]), load_s=float(m["load_s"]),
            pinned=bool(m.get("pinned", False))) for m in data["models"]]
    except (KeyError, TypeError, ValueError) as error:
        raise typer.BadParameter(f"{path}: {error!r} (format: costd/whatif/consolidation.py)")
    return cost_pb2.ConsolidationRequest(
        models=models, scenario=scenario,
        device_memory_mib=device_memory_mib or float(data.get("device_memory_mib", 0)))


def print_consolidation(r: cost_pb2.ConsolidationResponse) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table
    c = r.currency
    per_model = Table(title="per model (own: dedicated devices; shared: pro rata to device time)",
                      box=box.SIMPLE_HEAD)
    for column in ("model", "own device-h", "own cost", f"own {c}/1M", "shared cost",
                   f"shared {c}/1M", "loads", "loading s"):
        per_model.add_column(column, justify="left" if column == "model" else "right")
    for m in r.models:
        per_model.add_row(m.name, f"{m.dedicated_device_hours:g}", m.dedicated_cost,
                          m.dedicated_cost_per_million_tokens or "-", m.shared_cost,
                          m.shared_cost_per_million_tokens or "-", str(m.loads),
                          f"{m.loading_s:g}")
    layouts = Table(title="layouts", box=box.SIMPLE_HEAD)
    for column in ("layout", "feasible", "peak devices", "device-h", "utilisation", "cost",
                   f"{c}/1M tokens", "loading s"):
        layouts.add_column(column, justify="left" if column == "layout" else "right")
    for name, layout in (("dedicated", r.dedicated), ("shared", r.shared)):
        layouts.add_row(name, "yes" if layout.feasible else "NO", str(layout.devices_needed),
                        f"{layout.device_hours:g}", f"{layout.utilisation:.1%}", layout.cost,
                        layout.cost_per_million_tokens or "-", f"{layout.loading_s:g}")
    console = Console(width=None if sys.stdout.isatty() else 110)
    console.print(per_model, layouts)
    for name, layout in (("dedicated", r.dedicated), ("shared", r.shared)):
        console.print(f"{name} devices by hour: {' '.join(map(str, layout.devices_by_hour))}")
        for reason in layout.reasons:
            console.print(f"  - {reason}", markup=False)
    if r.saving:
        console.print(f"saving: {_money(r.saving, c)} ({r.saving_pct:.1f}% of dedicated); "
                      f"cheaper: {r.cheaper}", markup=False)
    else:
        console.print(f"saving: - (a layout is infeasible); cheaper: {r.cheaper or 'neither'}")
    for caveat in r.caveats:
        console.print(f"note: {caveat}", markup=False)


def whatif_consolidate(
        models: str = typer.Option(..., help="models JSON file (format: costd/whatif/consolidation.py)"),
        device: str = typer.Option("cpu", help="device: a100, h100, h200, cpu, or a device type"),
        device_memory_mib: float = typer.Option(0.0, help="one device's memory, MiB; 0: the file's"),
        costd: str = typer.Option(DEFAULT_COSTD, help="costd address"),
        local: bool = typer.Option(False, "--local", help="answer here, without costd"),
        price_per_hour: str = typer.Option("", help="decimal $/hour; empty: the price book's"),
        max_batch: int = typer.Option(0, help="largest batch per device; 0: each curve's"),
        max_devices: int = typer.Option(0, help="devices available to each layout; 0: no limit"),
        target_utilisation: float = typer.Option(1.0, help="planned busy share, (0, 1]"),
        autoscale: bool = typer.Option(False, help="devices follow each hour's demand"),
        p95_slo_s: float = typer.Option(0.0, help="p95 latency target, s; 0: none"),
        as_json: bool = typer.Option(False, "--json", help="print the answer as JSON")) -> None:
    """k models sharing devices vs a device each: cost, device-hours, loading, saving."""
    request = models_request(models, cost_pb2.Scenario(
        device=device, price_per_hour=price_per_hour, max_batch=max_batch,
        max_devices=max_devices, target_utilisation=target_utilisation, autoscale=autoscale,
        p95_latency_slo_s=p95_slo_s), device_memory_mib)
    response = _ask_whatif("WhatIfConsolidation", request, cost_pb2.ConsolidationResponse(),
                           costd, local, "--consolidation")
    if as_json:
        typer.echo(json_format.MessageToJson(response))
    else:
        print_consolidation(response)


def register(app: typer.Typer) -> None:
    app.command("bill")(bill)
    app.command("whatif")(whatif)
    app.command("whatif-consolidate")(whatif_consolidate)
