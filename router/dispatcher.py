"""Reads both class queues as one consumer group and runs each request on a worker.

Interactive entries are read first; `batch_min_share` guarantees batch a floor of the
dispatches so a steady interactive stream can never starve it. An entry is acknowledged
only after its request has ended (completion or typed error written to its result stream).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from opentelemetry import trace
from redis.exceptions import RedisError, ResponseError

from llmmesh import queue, telemetry
from llmmesh.v1 import worker_pb2
from router.policy import Policy
from router.registry import WorkerHandle, WorkerRegistry
from router.relay import MAX_ATTEMPTS, RequestFailed, RequestProgress, record_usage, run_attempt

log = logging.getLogger("router.dispatcher")


@dataclass(frozen=True, slots=True)
class DispatcherConfig:
    consumer: str
    batch_min_share: float = 0.2
    block_ms: int = 200

    def __post_init__(self):
        if not 0.0 <= self.batch_min_share <= 1.0:
            raise ValueError("batch_min_share must be in [0, 1]")


class Dispatcher:
    def __init__(self, redis: aioredis.Redis, registry: WorkerRegistry, policy: Policy,
                 config: DispatcherConfig, tracer: trace.Tracer):
        self.redis, self.registry, self.policy = redis, registry, policy
        self.config, self.tracer = config, tracer
        self.running: dict[str, tuple[asyncio.Task, RequestProgress]] = {}
        self._slot_freed = asyncio.Event()
        self._dispatched = {"interactive": 0, "batch": 0}

    async def ensure_groups(self) -> None:
        for cls in queue.CLASSES:
            with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists already
                await self.redis.xgroup_create(queue.queue_stream(cls), queue.ROUTER_GROUP,
                                               id="0", mkstream=True)

    def _read_order(self) -> list[str]:
        total = sum(self._dispatched.values())
        if total and self._dispatched["batch"] / total < self.config.batch_min_share:
            return ["batch", "interactive"]
        return ["interactive", "batch"]

    async def _read(self, capacity: int) -> list[tuple[str, str, dict]]:
        got: list[tuple[str, str, dict]] = []
        for cls in self._read_order():
            if len(got) >= capacity:
                break
            reply = await self.redis.xreadgroup(
                queue.ROUTER_GROUP, self.config.consumer, {queue.queue_stream(cls): ">"},
                count=capacity - len(got))
            got += [(cls, eid, f) for _, entries in reply or () for eid, f in entries]
        if not got:
            streams = {queue.queue_stream(c): ">" for c in self._read_order()}
            reply = await self.redis.xreadgroup(queue.ROUTER_GROUP, self.config.consumer, streams,
                                                count=1, block=self.config.block_ms)
            got += [(s.rsplit(":", 1)[1], eid, f) for s, entries in reply or () for eid, f in entries]
        return got

    async def run(self) -> None:
        await self.ensure_groups()
        while True:
            capacity = sum(h.free_slots for h in self.registry.workers.values())
            if capacity <= 0:
                self._slot_freed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), 0.5)
                continue
            try:
                entries = await self._read(capacity)
            except RedisError as exc:
                log.warning("queue read failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
                continue
            for cls, entry_id, fields in entries:
                self._dispatched[cls] += 1
                self._start(cls, entry_id, fields)

    def _start(self, cls: str, entry_id: str, fields: dict) -> None:
        entry = queue.QueueEntry.decode(fields)
        progress = RequestProgress(entry)
        task = asyncio.create_task(self._serve(cls, entry_id, progress))
        self.running[entry.request_id] = (task, progress)
        task.add_done_callback(lambda _: self.running.pop(entry.request_id, None))

    async def _serve(self, cls: str, entry_id: str, p: RequestProgress) -> None:
        e = p.entry
        ctx = telemetry.extract_context(e.traceparent)
        with self.tracer.start_as_current_span("router dispatch", context=ctx) as span:
            try:
                reason, device = await self._attempts(p)
                await self.redis.xadd(queue.result_stream(e.request_id),
                                      queue.final_event(reason, p.usage()))
                record_usage(span, p, reason, device)
            except RequestFailed as exc:
                span.set_status(trace.StatusCode.ERROR, exc.message)
                if p.delivered:
                    record_usage(span, p, "error", "")
                await self.redis.xadd(queue.result_stream(e.request_id),
                                      queue.error_event(exc.code, exc.message))
            await self.redis.expire(queue.result_stream(e.request_id), queue.RESULT_TTL_S)
            await self.redis.xack(queue.queue_stream(cls), queue.ROUTER_GROUP, entry_id)

    async def _attempts(self, p: RequestProgress) -> tuple[str, str]:
        e = p.entry
        if e.deadline_unix_ns and time.time_ns() >= e.deadline_unix_ns:
            raise RequestFailed("DEADLINE_EXCEEDED", "deadline passed while the request was queued")
        if await self.redis.exists(queue.cancel_key(e.request_id)):
            raise RequestFailed("CANCELLED", "request cancelled before it started")
        while p.attempts < MAX_ATTEMPTS:
            worker = await self._pick(e)
            p.worker_ids.append(worker.worker_id)
            worker.num_inflight += 1
            try:
                reason = await run_attempt(p, worker, self.redis)
            finally:
                worker.num_inflight -= 1
                self._slot_freed.set()
            p.attempts += 1
            if reason is not None:
                device = worker.load.device_type if worker.load else ""
                return reason, device
            worker.healthy = False  # until its lease is renewed and a probe succeeds
        await self.redis.xadd(queue.DEAD_LETTER_STREAM, p.entry.encode())
        raise RequestFailed("UNAVAILABLE", f"request failed on {MAX_ATTEMPTS} workers; retry later")

    async def _pick(self, entry: queue.QueueEntry) -> WorkerHandle:
        while True:
            worker = self.policy.select_worker(entry, self.registry.available())
            if worker is not None:
                self.policy.on_dispatched(entry, worker)
                return worker
            self._slot_freed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), 0.5)

    async def watch_cancels(self) -> None:
        """Abort requests whose client went away (the gateway publishes their ids)."""
        while True:
            try:
                pubsub = self.redis.pubsub()
                await pubsub.subscribe(queue.CANCEL_CHANNEL)
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    running = self.running.get(message["data"])
                    if running is not None:
                        await self._abort_on_worker(running[1])
            except RedisError as exc:
                log.warning("cancel channel lost (%s); resubscribing", exc)
                await asyncio.sleep(0.5)

    async def _abort_on_worker(self, p: RequestProgress) -> None:
        handle = self.registry.workers.get(p.worker_ids[-1]) if p.worker_ids else None
        if handle is not None:
            with contextlib.suppress(Exception):
                await handle.stub.Abort(worker_pb2.AbortRequest(request_id=p.entry.request_id),
                                        timeout=1.0)
