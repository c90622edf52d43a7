"""The batch-job API's core: submit many prompts as one job, follow it, stream its results.

Job state lives in Redis (llmmesh.jobs) and routers record each item's outcome there, so a
job survives gateway restarts and results stay retrievable for the TTL.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from gateway.frontend import Frontend
from gateway.tenants import Tenant
from gateway.validation import ValidRequest
from llmmesh import jobs, queue
from llmmesh.admission import Reservation
from llmmesh.admission import keys as admission_keys
from llmmesh.errors import InvalidArgument, NotFound, ResourceExhausted
from llmmesh.vocab import RequestClass

MAX_REQUESTS_PER_JOB = 10_000
_POLL_BLOCK_MS = 1000


class BatchJobs:
    def __init__(self, redis: aioredis.Redis, frontend: Frontend,
                 results_ttl_s: int = jobs.DEFAULT_RESULTS_TTL_S):
        self.redis = redis
        self.frontend = frontend
        self.results_ttl_s = results_ttl_s

    async def submit(self, tenant: Tenant, items: list[ValidRequest], display_name: str) -> dict:
        if not items:
            raise InvalidArgument("requests", "must hold at least one request")
        if len(items) > MAX_REQUESTS_PER_JOB:
            raise InvalidArgument("requests", f"at most {MAX_REQUESTS_PER_JOB} per job, got {len(items)}")
        for item in items:
            tenant.check_model(item.model.name, item.model.allowed_tenants)
        job_id = uuid.uuid4().hex
        reservations = await self._reserve_budget(tenant, job_id, items)
        stream = queue.queue_stream(RequestClass.BATCH)
        if await self.redis.xlen(stream) + len(items) > self.frontend.config.max_queue_len:
            raise ResourceExhausted("batch queue is full", retry_after_s=30.0)
        now = time.time()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(jobs.job_key(job_id), mapping={
                "tenant_id": tenant.tenant_id, "display_name": display_name,
                "num_requests": len(items), "created_unix_s": now, "cancelled": 0,
                "num_completed": 0, "num_failed": 0, "prompt_tokens": 0, "completion_tokens": 0,
                "results_ttl_s": self.results_ttl_s})
            pipe.expire(jobs.job_key(job_id), self.results_ttl_s)
            for i, item in enumerate(items):
                entry = self.frontend.build_entry(tenant, item, RequestClass.BATCH, 0)
                entry.request_id = f"{job_id}-{i}"
                entry.job_id, entry.job_index = job_id, i
                entry.reservation = reservations[i]
                pipe.xadd(stream, entry.encode())
            await pipe.execute()
        return await self.get(tenant, job_id)

    async def _reserve_budget(self, tenant: Tenant, job_id: str, items) -> list[dict]:
        """One reservation for the whole job; each item settles its own share when it ends.
        Rate and concurrency limits are for interactive traffic: a job is paced by the queue."""
        plan = tenant.plan
        needs = [len(x.prompt_token_ids) + x.sampling["max_tokens"] for x in items]
        if not plan.token_budget:
            return [{} for _ in items]
        period, period_end_s = plan.period(time.time())
        code, retry_s = await self.frontend.admission.admit(
            tenant_id=tenant.tenant_id, request_id=job_id, rpm=0, tpm=0, max_concurrent=0,
            budget=plan.token_budget, period=period, period_end_s=period_end_s,
            tokens=sum(needs), lease_s=1.0)
        if code:
            raise ResourceExhausted(f"tenant {tenant.tenant_id}: the job's {sum(needs)} tokens "
                                    "exceed what is left of the token budget", retry_s)
        budget_key = admission_keys(tenant.tenant_id, period)[3]
        return [Reservation(tenant.tenant_id, f"{job_id}-{i}", n, budget_key).to_dict()
                for i, n in enumerate(needs)]

    async def _job(self, tenant: Tenant, job_id: str) -> dict:
        raw = await self.redis.hgetall(jobs.job_key(job_id)) if job_id else {}
        # Another tenant's job is reported exactly like a missing one.
        if not raw or raw.get("tenant_id") != tenant.tenant_id:
            raise NotFound(f"batch job {job_id!r} not found")
        return raw

    async def get(self, tenant: Tenant, job_id: str) -> dict:
        raw = await self._job(tenant, job_id)
        job = {k: raw.get(k, "") for k in ("display_name",)}
        for k in ("num_requests", "num_completed", "num_failed", "prompt_tokens",
                  "completion_tokens", "results_ttl_s"):
            job[k] = int(raw.get(k, 0))
        job["job_id"], job["created_unix_s"] = job_id, float(raw["created_unix_s"])
        finished = job["num_completed"] + job["num_failed"] == job["num_requests"]
        job["status"] = "cancelled" if raw.get("cancelled") == "1" else (
            "completed" if finished else "running")
        return job

    async def results(self, tenant: Tenant, job_id: str) -> AsyncIterator[dict]:
        total = int((await self._job(tenant, job_id))["num_requests"])
        last_id, seen = "0-0", 0
        while seen < total:
            reply = await self.redis.xread({jobs.job_results_key(job_id): last_id}, count=256,
                                           block=_POLL_BLOCK_MS)
            for _, entries in reply or ():
                for entry_id, fields in entries:
                    last_id, seen = entry_id, seen + 1
                    yield json.loads(fields["d"])
            if not reply:
                await self._job(tenant, job_id)  # expired meanwhile: NOT_FOUND, not a hang

    async def cancel(self, tenant: Tenant, job_id: str) -> dict:
        job = await self.get(tenant, job_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(jobs.job_key(job_id), "cancelled", 1)
            for i in range(job["num_requests"]):
                rid = f"{job_id}-{i}"
                pipe.set(queue.cancel_key(rid), "1", ex=queue.RESULT_TTL_S)
                pipe.publish(queue.CANCEL_CHANNEL, rid)
            await pipe.execute()
        return await self.get(tenant, job_id)
