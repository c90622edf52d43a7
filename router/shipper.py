"""Ships billing records from Redis to costd; a record leaves Redis only after costd took it.

Every router runs one; they share the `shippers` consumer group, and records a dead shipper
held are taken over after `claim_idle_ms`. costd answers an Export only after its ledger
committed, so the XACK that follows can never lose a bill; an export that fails (costd down,
overloaded, restarting) leaves the records pending and is retried with backoff — the bills
wait in Redis (AOF) for as long as the outage lasts. Shipped records are kept for
`retention_s` (llmmesh.billing.RETENTION_S), for the reconciler, then trimmed.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

import grpc
import redis.asyncio as aioredis
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from redis.exceptions import ResponseError

from llmmesh import billing, mtls
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity
from router import faults

log = logging.getLogger("router.shipper")
BATCH = 256
TRIM_EVERY_S = 60.0


class BillingShipper:
    def __init__(self, redis: aioredis.Redis, costd_address: str, identity: MeshIdentity,
                 consumer: str, claim_idle_ms: int = 30_000, block_ms: int = 200,
                 retention_s: float = billing.RETENTION_S):
        self.redis, self.consumer = redis, consumer
        self.claim_idle_ms, self.block_ms = claim_idle_ms, block_ms
        self.retention_s = retention_s
        self._trimmed_at = 0.0
        self.channel = mtls.aio_channel(costd_address, identity, Role.COSTD)
        self.stub = trace_service_pb2_grpc.TraceServiceStub(self.channel)
        self.num_shipped = 0
        self.num_refused = 0

    async def ensure_group(self) -> None:
        with contextlib.suppress(ResponseError):   # BUSYGROUP
            await self.redis.xgroup_create(billing.BILLING_STREAM, billing.SHIPPER_GROUP, id="0",
                                           mkstream=True)

    async def run(self) -> None:
        await self.ensure_group()
        failures = 0
        while True:
            try:
                entries = await self._next_batch()
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await self.ensure_group()
                continue
            if time.monotonic() - self._trimmed_at > TRIM_EVERY_S:
                self._trimmed_at = time.monotonic()
                await billing.trim_shipped(self.redis, self.retention_s)
            if not entries:
                continue
            if await self._ship(entries):
                failures = 0
            else:
                failures += 1
                await asyncio.sleep(min(5.0, 0.1 * 2 ** failures) * random.uniform(0.5, 1.0))

    async def _next_batch(self) -> list[tuple[str, dict]]:
        # Ours that an earlier try left pending first, then a dead shipper's, then new ones.
        mine = await self.redis.xreadgroup(billing.SHIPPER_GROUP, self.consumer,
                                           {billing.BILLING_STREAM: "0"}, count=BATCH)
        entries = [e for _, es in mine or () for e in es if e[1]]
        if entries:
            return entries
        _, claimed, _ = await self.redis.xautoclaim(
            billing.BILLING_STREAM, billing.SHIPPER_GROUP, self.consumer, self.claim_idle_ms,
            start_id="0-0", count=BATCH)
        if claimed:
            return [e for e in claimed if e[1]]
        fresh = await self.redis.xreadgroup(billing.SHIPPER_GROUP, self.consumer,
                                            {billing.BILLING_STREAM: ">"}, count=BATCH,
                                            block=self.block_ms)
        return [e for _, es in fresh or () for e in es]

    async def _ship(self, entries: list[tuple[str, dict]]) -> bool:
        faults.reached("before-ship")
        try:
            reply = await self.stub.Export(billing.export_request(entries), timeout=10)
        except grpc.aio.AioRpcError as exc:
            log.warning("billing export of %d records failed (%s); kept in Redis, retrying",
                        len(entries), exc.code().name)
            return False
        if reply.partial_success.rejected_spans:
            # Permanent (malformed or refused): retrying the same bytes can never succeed.
            self.num_refused += reply.partial_success.rejected_spans
            log.error("costd refused %d billing records: %s", reply.partial_success.rejected_spans,
                      reply.partial_success.error_message)
        faults.reached("shipped")
        ids = [entry_id for entry_id, _ in entries]
        # Acknowledged, not deleted: trim_shipped drops it after the retention.
        await self.redis.xack(billing.BILLING_STREAM, billing.SHIPPER_GROUP, *ids)
        self.num_shipped += len(ids)
        return True

    async def close(self) -> None:
        await self.channel.close()
