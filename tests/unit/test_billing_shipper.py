"""The router's billing shipper against a real redis-server: a record costd took is
acknowledged and kept (for the reconciler), one costd did not take stays pending."""
from __future__ import annotations

import asyncio

import grpc
import redis.asyncio as aioredis
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from llmmesh import billing
from llmmesh.identity import Role
from router.shipper import BillingShipper


class _Costd:
    def __init__(self, up: bool):
        self.up, self.num_exports = up, 0

    async def Export(self, request, timeout=None):
        self.num_exports += 1
        if not self.up:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "costd down")
        return trace_service_pb2.ExportTraceServiceResponse()


def _ship_once(redis_server, identity, up: bool) -> list[billing.BillingRecord]:
    async def main():
        redis = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        shipper = BillingShipper(redis, "127.0.0.1:1", identity(Role.ROUTER), "s0")
        shipper.stub = _Costd(up)
        try:
            await shipper.ensure_group()
            attributes = billing.record_attributes(
                request_id="r1", tenant_id="acme", model="m", request_class="batch",
                usage={"prompt_tokens": 3, "cached_prompt_tokens": 0, "completion_tokens": 2,
                       "prefill_device_s": 0.0, "decode_device_s": 0.0},
                finish_reason="stop", device_type="cpu", worker_ids=["w0"])
            await redis.xadd(billing.BILLING_STREAM, billing.encode_record(
                attributes, start_unix_ns=1, end_unix_ns=2))
            assert await shipper._ship(await shipper._next_batch()) is up
            assert shipper.stub.num_exports == 1
            return await billing.read_records(redis, 0)
        finally:
            await shipper.close()
            await redis.aclose()
    return asyncio.run(main())


def test_a_shipped_record_is_acknowledged_and_kept(redis_server, identity):
    (record,) = _ship_once(redis_server, identity, up=True)
    assert (record.request_id, record.shipped) == ("r1", True)


def test_a_record_costd_did_not_take_stays_pending(redis_server, identity):
    (record,) = _ship_once(redis_server, identity, up=False)
    assert (record.request_id, record.shipped) == ("r1", False)
