"""proto ↔ domain for CostService; every bad field becomes INVALID_ARGUMENT naming it."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation

from costd.billing import BillingQuery, InvoiceSet
from costd.costmodel import CostLine, DeviceReconciliation, IdlePolicy, TokenKind
from costd.invoice import Invoice
from costd.periods import Granularity
from costd.whatif.consolidation import ConsolidationResult, FieldError, Layout, ModelLoad
from costd.whatif.curve import ThroughputCurve, parse_curve
from costd.whatif.model import WhatIfResult
from costd.whatif.profile import Lengths, Scenario, TrafficProfile
from llmmesh.errors import InvalidArgument
from llmmesh.v1 import cost_pb2

NS_PER_S = 1_000_000_000
GRANULARITIES = {cost_pb2.GRANULARITY_TOTAL: Granularity.TOTAL,
                 cost_pb2.GRANULARITY_HOUR: Granularity.HOUR,
                 cost_pb2.GRANULARITY_DAY: Granularity.DAY,
                 cost_pb2.GRANULARITY_MONTH: Granularity.MONTH}
IDLE_POLICIES = {cost_pb2.IDLE_POLICY_UNUSED: IdlePolicy.UNUSED,
                 cost_pb2.IDLE_POLICY_PRO_RATA: IdlePolicy.PRO_RATA}
TOKEN_KINDS = {TokenKind.PROMPT: cost_pb2.TOKEN_KIND_PROMPT,
               TokenKind.COMPLETION: cost_pb2.TOKEN_KIND_COMPLETION,
               TokenKind.IDLE: cost_pb2.TOKEN_KIND_IDLE,
               TokenKind.LOADING: cost_pb2.TOKEN_KIND_LOADING}


def time_range_ns(start_unix_s: float, end_unix_s: float,
                  now_ns: int | None = None) -> tuple[int, int | None]:
    """[start, end) in Unix ns; end 0 gives None ("no upper bound") unless `now_ns` is given."""
    for name, value in (("start_unix_s", start_unix_s), ("end_unix_s", end_unix_s)):
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(name, f"must be a finite number >= 0, got {value}")
    start_ns = round(start_unix_s * NS_PER_S)
    if end_unix_s == 0:
        return start_ns, now_ns
    end_ns = round(end_unix_s * NS_PER_S)
    if end_ns < start_ns:
        raise InvalidArgument("end_unix_s", f"{end_unix_s} is before start_unix_s {start_unix_s}")
    return start_ns, end_ns


def billing_query(query: cost_pb2.BillingQuery, default_granularity: Granularity,
                  default_policy: IdlePolicy) -> BillingQuery:
    start_ns, end_ns = time_range_ns(query.start_unix_s, query.end_unix_s, time.time_ns())
    return BillingQuery(start_ns, max(end_ns, start_ns), query.tenant_id,
                        GRANULARITIES.get(query.granularity, default_granularity),
                        IDLE_POLICIES.get(query.idle_policy, default_policy))


def money(value: Decimal | None) -> str:
    return "" if value is None else format(value, "f")


def line_proto(line: CostLine) -> cost_pb2.InvoiceLine:
    return cost_pb2.InvoiceLine(
        period_start_unix_s=line.period_start_ns / NS_PER_S,
        period_end_unix_s=line.period_end_ns / NS_PER_S, model=line.model,
        request_class=line.request_class, device=line.device,
        token_kind=TOKEN_KINDS[line.token_kind], requests=line.num_requests,
        tokens=line.num_tokens, cached_tokens=line.num_cached_tokens, device_ns=line.device_ns,
        cost=money(line.cost), list_cost=money(line.list_cost),
        cost_per_million_tokens=money(line.cost_per_million_tokens))


def invoice_proto(invoice: Invoice) -> cost_pb2.Invoice:
    return cost_pb2.Invoice(
        tenant_id=invoice.tenant_id, lines=[line_proto(l) for l in invoice.lines],
        requests=invoice.num_requests, prompt_tokens=invoice.num_prompt_tokens,
        cached_prompt_tokens=invoice.num_cached_prompt_tokens,
        completion_tokens=invoice.num_completion_tokens,
        prompt_cost=money(invoice.prompt_cost), completion_cost=money(invoice.completion_cost),
        idle_cost=money(invoice.idle_cost), loading_cost=money(invoice.loading_cost),
        total=money(invoice.total),
        amount_due=money(invoice.amount_due),
        prompt_cost_per_million_tokens=money(invoice.prompt_cost_per_million),
        completion_cost_per_million_tokens=money(invoice.completion_cost_per_million))


def _device_proto(d: DeviceReconciliation) -> cost_pb2.DeviceReconciliation:
    return cost_pb2.DeviceReconciliation(
        device=d.device, capacity_ns=d.capacity_ns, attributed_ns=d.attributed_ns,
        idle_ns=d.idle_ns, capacity_cost=money(d.capacity_cost),
        attributed_cost=money(d.attributed_cost),
        idle_allocated_cost=money(d.idle_allocated_cost),
        idle_unallocated_cost=money(d.idle_unallocated_cost),
        loading_ns=d.loading_ns, loading_cost=money(d.loading_cost))


def invoice_response(result: InvoiceSet) -> cost_pb2.GetInvoiceResponse:
    s = result.statement
    response = cost_pb2.GetInvoiceResponse(
        currency=s.currency, start_unix_s=s.start_ns / NS_PER_S, end_unix_s=s.end_ns / NS_PER_S,
        invoices=[invoice_proto(i) for i in result.invoices], warnings=list(s.warnings))
    if result.fleet is not None:
        f = result.fleet
        response.reconciliation.CopyFrom(cost_pb2.Reconciliation(
            capacity_cost=money(f.capacity_cost), tenants_cost=money(f.tenants_cost),
            unused_cost=money(f.unused_cost), capacity_due=money(f.capacity_due),
            tenants_due=money(f.tenants_due), unused_due=money(f.unused_due),
            devices=[_device_proto(d) for d in s.devices],
            workers=[cost_pb2.WorkerCapacity(device=d, worker_id=w, uptime_ns=ns)
                     for d, w, ns in s.worker_capacity_ns],
            unused_lines=[line_proto(l) for l in s.lines_of("")]))
    return response


def _lengths(buckets, field: str) -> Lengths:
    try:
        return Lengths(tuple((float(b.tokens), b.weight) for b in buckets))
    except ValueError as error:
        raise InvalidArgument(field, str(error)) from error


def profile_of(p: cost_pb2.TrafficProfile) -> TrafficProfile:
    try:
        return TrafficProfile(tuple(p.requests_per_s_by_hour),
                              _lengths(p.prompt_tokens, "profile.prompt_tokens"),
                              _lengths(p.completion_tokens, "profile.completion_tokens"),
                              p.prefix_hit_rate)
    except ValueError as error:
        raise InvalidArgument("profile", str(error)) from error


def scenario_of(s: cost_pb2.Scenario) -> Scenario:
    try:
        price = Decimal(s.price_per_hour) if s.price_per_hour else None
    except InvalidOperation as error:
        raise InvalidArgument("scenario.price_per_hour", f"not a decimal: {s.price_per_hour!r}") from error
    try:
        return Scenario(s.device, price, s.quantization, s.max_batch,
                        s.prompt_length_change_pct, s.max_devices,
                        s.target_utilisation or 1.0, s.autoscale, s.p95_latency_slo_s)
    except ValueError as error:
        raise InvalidArgument("scenario", str(error)) from error


def whatif_response(r: WhatIfResult, currency: str) -> cost_pb2.WhatIfResponse:
    return cost_pb2.WhatIfResponse(
        feasible=r.feasible, reasons=list(r.reasons), currency=currency,
        cost_per_million_tokens=money(r.cost_per_million_tokens),
        prompt_cost_per_million_tokens=money(r.prompt_cost_per_million_tokens),
        completion_cost_per_million_tokens=money(r.completion_cost_per_million_tokens),
        cost_per_million_tokens_at_full_utilisation=money(
            r.cost_per_million_tokens_at_full_utilisation),
        cost=money(r.cost), devices_needed=r.devices_needed, device_hours=r.device_hours,
        utilisation=r.utilisation, p95_latency_s=r.p95_latency_s, concurrency=r.concurrency,
        tokens_per_s_per_device=r.tokens_per_s_per_device, tokens=r.tokens, curve=r.curve,
        hours=[cost_pb2.WhatIfHour(hour=h.hour, requests_per_s=h.requests_per_s,
                                   tokens_per_s=h.tokens_per_s, devices=h.devices,
                                   utilisation=h.utilisation, cost=money(h.cost))
               for h in r.hours])


def _within(prefix: str, error: InvalidArgument) -> InvalidArgument:
    return InvalidArgument(f"{prefix}.{error.field}", error.message[len(error.field) + 2:])


def consolidation_models(models: Sequence[cost_pb2.ConsolidationModel],
                         curve_named: Callable[[str], ThroughputCurve]) -> list[ModelLoad]:
    """The request's models, each curve resolved by name unless given inline."""
    loads = []
    for i, m in enumerate(models):
        field = f"models[{i}]"
        try:
            profile = profile_of(m.profile)
        except InvalidArgument as error:
            raise _within(field, error) from error
        if not (m.curve or m.curve_json):
            raise InvalidArgument(f"{field}.curve", "give a curve name or curve_json")
        try:
            curve = parse_curve(m.curve_json, m.name) if m.curve_json else curve_named(m.curve)
        except ValueError as error:
            raise InvalidArgument(f"{field}.curve", str(error)) from error
        try:
            loads.append(ModelLoad(m.name, profile, curve, m.memory_mib, m.load_s, m.pinned))
        except FieldError as error:
            raise InvalidArgument(f"{field}.{error.field}", error.problem) from error
    return loads


def _layout_proto(layout: Layout) -> cost_pb2.ConsolidationLayout:
    return cost_pb2.ConsolidationLayout(
        feasible=layout.feasible, reasons=list(layout.reasons), cost=money(layout.cost),
        devices_needed=layout.devices_needed, device_hours=layout.device_hours,
        utilisation=layout.utilisation,
        cost_per_million_tokens=money(layout.cost_per_million_tokens),
        loading_s=layout.loading_s, devices_by_hour=list(layout.devices_by_hour))


def consolidation_response(r: ConsolidationResult,
                           currency: str) -> cost_pb2.ConsolidationResponse:
    return cost_pb2.ConsolidationResponse(
        currency=currency, dedicated=_layout_proto(r.dedicated), shared=_layout_proto(r.shared),
        models=[cost_pb2.ConsolidationModelResult(
            name=m.name, curve=m.dedicated.curve, tokens=m.dedicated.tokens,
            concurrency=m.dedicated.concurrency, p95_latency_s=m.dedicated.p95_latency_s,
            busy_s=m.busy_s, dedicated_cost=money(m.dedicated.cost),
            dedicated_device_hours=m.dedicated.device_hours,
            dedicated_cost_per_million_tokens=money(m.dedicated.cost_per_million_tokens),
            shared_cost=money(m.shared_cost),
            shared_cost_per_million_tokens=money(m.shared_cost_per_million_tokens),
            loads=m.num_loads, loading_s=m.loading_s) for m in r.models],
        hours=[cost_pb2.ConsolidationHour(
            hour=h.hour, dedicated_devices=h.dedicated_devices, shared_devices=h.shared_devices,
            busy_devices=h.busy_devices, loading_s=h.loading_s, loaded=list(h.loaded))
            for h in r.hours],
        saving=money(r.saving), saving_pct=r.saving_pct or 0.0, cheaper=r.cheaper,
        caveats=list(r.caveats))
