"""CostService: a thin gRPC edge over billing (proto ↔ domain via costd.convert, nothing else).

Every call needs an API key (costd.access): a tenant's reads its own tenant's bills, the admin
key the fleet's; what-if answers are open to either. Errors are raised, not aborted:
llmmesh.server's interceptor owns the status-code table.
Billing work runs SQL and builds files, so it runs on a worker thread, never on the loop.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from costd import convert
from costd.access import CostAccess, authorize_read
from costd.billing import Billing, Schema
from costd.costmodel import IdlePolicy
from costd.export import ExportFormat
from costd.ledger import TenantUsage, UsageLedger
from costd.periods import Granularity
from costd.whatif.consolidation import FieldError
from costd.whatif.planner import WhatIfPlanner
from llmmesh.errors import InvalidArgument
from llmmesh.v1 import cost_pb2, cost_pb2_grpc

# gRPC's default message limit is 4 MiB; chunks stay well under it.
CHUNK_BYTES = 1 << 20
_SCHEMAS = {cost_pb2.EXPORT_SCHEMA_UNSPECIFIED: Schema.FOCUS,
            cost_pb2.EXPORT_SCHEMA_FOCUS: Schema.FOCUS,
            cost_pb2.EXPORT_SCHEMA_INVOICE_LINES: Schema.INVOICE_LINES,
            cost_pb2.EXPORT_SCHEMA_CLOUDEVENTS: Schema.CLOUDEVENTS}
_FORMATS = {cost_pb2.EXPORT_FORMAT_CSV: ExportFormat.CSV,
            cost_pb2.EXPORT_FORMAT_PARQUET: ExportFormat.PARQUET,
            cost_pb2.EXPORT_FORMAT_JSONL: ExportFormat.JSONL}

def usage_response(usage: TenantUsage) -> cost_pb2.GetUsageResponse:
    return cost_pb2.GetUsageResponse(
        tenant_id=usage.tenant_id, requests=usage.num_requests,
        prompt_tokens=usage.num_prompt_tokens,
        cached_prompt_tokens=usage.num_cached_prompt_tokens,
        completion_tokens=usage.num_completion_tokens,
        prefill_device_seconds=usage.prefill_device_s,
        decode_device_seconds=usage.decode_device_s)


class CostServicer(cost_pb2_grpc.CostServiceServicer):
    def __init__(self, ledger: UsageLedger, billing: Billing, planner: WhatIfPlanner,
                 idle_policy: IdlePolicy = IdlePolicy.UNUSED, *, access: CostAccess) -> None:
        self._access = access
        self._ledger = ledger
        self._billing = billing
        self._planner = planner
        self._idle_policy = idle_policy

    async def GetUsage(self, request: cost_pb2.GetUsageRequest,
                       context: object) -> cost_pb2.GetUsageResponse:
        authorize_read(self._access.caller(context.invocation_metadata()), request.tenant_id)
        if not request.tenant_id:
            raise InvalidArgument("tenant_id", "is required")
        start_ns, end_ns = convert.time_range_ns(request.start_unix_s, request.end_unix_s)
        # An unknown tenant simply has no rows: zeros, not NOT_FOUND, so a new tenant's
        # first bill is a valid empty one.
        usage = await self._ledger.query_usage(request.tenant_id, start_ns, end_ns)
        return usage_response(usage)

    async def GetInvoice(self, request: cost_pb2.GetInvoiceRequest,
                         context: object) -> cost_pb2.GetInvoiceResponse:
        caller = self._access.caller(context.invocation_metadata())
        query = convert.billing_query(request.query, Granularity.TOTAL, self._idle_policy)
        authorize_read(caller, query.tenant_id)
        result = await asyncio.to_thread(self._billing.invoices, query)
        response = convert.invoice_response(result)
        if not caller.is_admin:
            # They name devices, prices and capacity: the fleet's books, not the tenant's.
            response.ClearField("warnings")
        return response

    async def ExportBilling(self, request: cost_pb2.ExportBillingRequest,
                            context: object) -> AsyncIterator[cost_pb2.ExportBillingChunk]:
        caller = self._access.caller(context.invocation_metadata())
        query = convert.billing_query(request.query, Granularity.DAY, self._idle_policy)
        authorize_read(caller, query.tenant_id)
        schema = _SCHEMAS.get(request.schema)
        if schema is None:
            raise InvalidArgument("schema", f"unknown value {request.schema}")
        default = ExportFormat.JSONL if schema == Schema.CLOUDEVENTS else ExportFormat.CSV
        fmt = _FORMATS.get(request.format, default)
        exported = await asyncio.to_thread(self._billing.export, query, schema, fmt)
        for offset in range(0, len(exported.data), CHUNK_BYTES):
            yield cost_pb2.ExportBillingChunk(data=exported.data[offset:offset + CHUNK_BYTES])
        yield cost_pb2.ExportBillingChunk(summary=cost_pb2.ExportSummary(
            rows=exported.num_rows, size_bytes=len(exported.data), sha256=exported.sha256,
            content_type=exported.content_type, file_extension=exported.extension))

    async def WhatIf(self, request: cost_pb2.WhatIfRequest,
                     context: object) -> cost_pb2.WhatIfResponse:
        self._access.caller(context.invocation_metadata())   # any authenticated caller
        profile = convert.profile_of(request.profile)
        scenario = convert.scenario_of(request.scenario)
        try:
            result = self._planner.answer(profile, scenario, request.curve_json)
        except ValueError as error:
            raise InvalidArgument("scenario", str(error)) from error
        return convert.whatif_response(result, self._planner.book.currency)

    async def WhatIfConsolidation(self, request: cost_pb2.ConsolidationRequest,
                                  context: object) -> cost_pb2.ConsolidationResponse:
        self._access.caller(context.invocation_metadata())   # any authenticated caller
        models = convert.consolidation_models(request.models, self._planner.curve_named)
        scenario = convert.scenario_of(request.scenario)
        try:
            result = self._planner.consolidate(models, scenario, request.device_memory_mib)
        except FieldError as error:
            raise InvalidArgument(error.field, error.problem) from error
        except ValueError as error:
            raise InvalidArgument("scenario", str(error)) from error
        return convert.consolidation_response(result, self._planner.book.currency)
