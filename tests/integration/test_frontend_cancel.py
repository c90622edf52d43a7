"""The gateway's frontend against a real redis-server: a client that goes away while the
enqueue script is in flight has its request aborted only if the script enqueued it. A refused
request's id may be another request's (another tenant's, or this client's own retry)."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from opentelemetry import trace

from gateway.frontend import Frontend, FrontendConfig
from gateway.tenants import Tenant
from gateway.validation import ServedModel, ValidRequest
from llmmesh import queue
from llmmesh.admission import ALREADY_USED


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def _start_request(frontend: Frontend, request_id: str) -> asyncio.Task:
    """One request of tenant acme through `frontend`, consumed in a task of its own."""
    req = ValidRequest(request_id, ServedModel("m", 2048, "int8", _Tokenizer()), [1, 2, 3],
                       {"max_tokens": 4, "stop": []}, "interactive")
    tenant = Tenant("acme", ("interactive", "batch"), "acme")

    async def consume():
        async for _ in frontend.generate(tenant, req, 0):
            pass
    return asyncio.create_task(consume())


@pytest.mark.parametrize("outcome", [(0, 0.0), (ALREADY_USED, 0.0)])
def test_cancel_during_enqueue_aborts_only_what_was_enqueued(redis_server, outcome):
    async def body():
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        frontend = Frontend(client, FrontendConfig(), trace.get_tracer("test"))
        started, release = asyncio.Event(), asyncio.Event()

        async def slow_enqueue(**_):          # the script's round trip, held open
            started.set()
            await release.wait()
            return outcome
        frontend.admission.admit_and_enqueue = slow_enqueue
        task = _start_request(frontend, "shared-id")
        await started.wait()
        task.cancel()                          # the client goes away mid-call
        await asyncio.sleep(0.05)
        release.set()                          # then the script's reply arrives
        with pytest.raises(asyncio.CancelledError):
            await task
        # Cancel keys name the mesh's id for the request: acme/shared-id/<nonce>.
        cancelled = len(await client.keys(queue.cancel_key("acme/shared-id/*")))
        await client.aclose()
        return cancelled
    cancelled = asyncio.run(body())
    # Enqueued: aborted. Refused (the id is someone else's): left alone.
    assert cancelled == (1 if outcome[0] == 0 else 0)


def test_a_cancel_lost_inside_redis_py_still_ends_the_relay_and_aborts(redis_server):
    """Python 3.11's asyncio.wait_for (around every redis-py send) returns its result instead of
    raising when a cancel lands as the send completes: the cancel is lost, the task goes on with
    cancelling() > 0. The relay must notice at its next read and still end the request (before
    the fix the client's request kept running to its end on the worker)."""
    async def body():
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        frontend = Frontend(client, FrontendConfig(), trace.get_tracer("test"))

        async def enqueue(**_):
            return (0, 0.0)
        frontend.admission.admit_and_enqueue = enqueue
        real_xread, reads = client.xread, []

        async def xread_losing_one_cancel(*args, **kwargs):
            reads.append(1)
            try:
                return await real_xread(*args, **kwargs)
            except asyncio.CancelledError:
                if len(reads) > 1:
                    raise
                return []        # what asyncio.wait_for does when its inner future is done
        client.xread = xread_losing_one_cancel
        task = _start_request(frontend, "lost-cancel")
        while not reads:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2.0)    # not a TimeoutError: the relay ended
        cancelled = len(await client.keys(queue.cancel_key("acme/lost-cancel/*")))
        await client.aclose()
        return cancelled, len(reads)
    cancelled, reads = asyncio.run(body())
    assert cancelled == 1 and reads <= 2


def test_open_calls_are_capped_per_tenant_and_per_gateway(redis_server):
    """Tenant cap 2, gateway cap 3: acme's third call and globex's second are refused, naming
    the flag; a call that ends (here: cancelled) gives its place back."""
    from llmmesh.errors import ResourceExhausted

    def start(frontend, tenant_id, request_id):
        req = ValidRequest(request_id, ServedModel("m", 2048, "int8", _Tokenizer()), [1, 2, 3],
                           {"max_tokens": 4, "stop": []}, "interactive")
        tenant = Tenant(tenant_id, ("interactive", "batch"), tenant_id)

        async def consume():
            async for _ in frontend.generate(tenant, req, 0):
                pass
        return asyncio.create_task(consume())

    async def body():
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        frontend = Frontend(client, FrontendConfig(max_streams_per_tenant=2, max_streams=3),
                            trace.get_tracer("test"))
        calls = [start(frontend, "acme", "a1"), start(frontend, "acme", "a2")]
        await asyncio.sleep(0.3)                       # admitted, waiting for tokens
        third = start(frontend, "acme", "a3")
        with pytest.raises(ResourceExhausted, match="--max-streams-per-tenant"):
            await third
        calls.append(start(frontend, "globex", "g1"))  # another tenant still may
        await asyncio.sleep(0.3)
        with pytest.raises(ResourceExhausted, match=r"--max-streams\)"):
            await start(frontend, "globex", "g2")      # the gateway is full
        assert (frontend.open_streams("acme"), frontend.open_streams("globex")) == (2, 1)
        calls[0].cancel()
        await asyncio.gather(calls[0], return_exceptions=True)
        calls.append(start(frontend, "globex", "g3"))  # the place came back
        await asyncio.sleep(0.3)
        assert not calls[-1].done() and frontend.open_streams("globex") == 2
        for c in calls:
            c.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        assert frontend.open_streams("acme") == frontend.open_streams("globex") == 0
        await client.aclose()
    asyncio.run(body())
