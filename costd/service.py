"""CostService: a thin gRPC edge over the usage ledger (proto ↔ domain, nothing else).

Errors are raised, not aborted: llmmesh.server's interceptor owns the status-code table.
"""
from __future__ import annotations

import math

from costd.ledger import TenantUsage, UsageLedger
from llmmesh.errors import InvalidArgument
from llmmesh.v1 import cost_pb2, cost_pb2_grpc

_NS_PER_S = 1_000_000_000


def time_range_ns(start_unix_s: float, end_unix_s: float) -> tuple[int, int | None]:
    """[start, end) in Unix ns; end None means no upper bound.

    The proto's "end 0 means now" is read as "no upper bound": every billed request has already
    ended, so the two agree except for a sender whose clock runs ahead, whose usage must not
    vanish from the bill.
    """
    for name, value in (("start_unix_s", start_unix_s), ("end_unix_s", end_unix_s)):
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(name, f"must be a finite number >= 0, got {value}")
    start_ns = round(start_unix_s * _NS_PER_S)
    if end_unix_s == 0:
        return start_ns, None
    end_ns = round(end_unix_s * _NS_PER_S)
    if end_ns < start_ns:
        raise InvalidArgument("end_unix_s", f"{end_unix_s} is before start_unix_s {start_unix_s}")
    return start_ns, end_ns


def usage_response(usage: TenantUsage) -> cost_pb2.GetUsageResponse:
    return cost_pb2.GetUsageResponse(
        tenant_id=usage.tenant_id,
        requests=usage.num_requests,
        prompt_tokens=usage.num_prompt_tokens,
        cached_prompt_tokens=usage.num_cached_prompt_tokens,
        completion_tokens=usage.num_completion_tokens,
        prefill_device_seconds=usage.prefill_device_s,
        decode_device_seconds=usage.decode_device_s,
    )


class CostServicer(cost_pb2_grpc.CostServiceServicer):
    def __init__(self, ledger: UsageLedger) -> None:
        self._ledger = ledger

    async def GetUsage(self, request: cost_pb2.GetUsageRequest,
                       context: object) -> cost_pb2.GetUsageResponse:
        if not request.tenant_id:
            raise InvalidArgument("tenant_id", "is required")
        start_ns, end_ns = time_range_ns(request.start_unix_s, request.end_unix_s)
        # An unknown tenant simply has no rows: zeros, not NOT_FOUND, so a new tenant's
        # first bill is a valid empty one.
        usage = await self._ledger.query_usage(request.tenant_id, start_ns, end_ns)
        return usage_response(usage)
