"""Admission against a real redis-server: limits hold under concurrent bursts."""
from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from llmmesh.admission import ALREADY_USED, QUEUE_FULL, Admission, Reservation, keys

UNLIMITED = dict(rpm=0, tpm=0, max_concurrent=0, budget=0)


async def _admit(adm, rid, tokens, tenant="t1", period="p", **limits):
    args = {**UNLIMITED, **limits}
    return await adm.admit(tenant_id=tenant, request_id=rid, period=period, period_end_s=4e9,
                           tokens=tokens, lease_s=60, **args)


def run(coro_fn, redis_server):
    async def main():
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        try:
            return await coro_fn(client)
        finally:
            await client.aclose()
    return asyncio.run(main())


def test_budget_never_overshoots_under_20_concurrent_requests(redis_server):
    async def body(client):
        adm = Admission(client)
        results = await asyncio.gather(*(_admit(adm, f"r{i}", 300, budget=1000) for i in range(20)))
        admitted = [i for i, (code, _) in enumerate(results) if code == 0]
        assert len(admitted) == 3  # 3 x 300 <= 1000 < 4 x 300
        assert all(code == 4 for code, _ in (results[i] for i in range(20) if i not in admitted))
        assert all(wait > 0 for code, wait in results if code)
        # Settling at actual use frees the unused part of each reservation.
        budget_key = keys("t1", "p")[3]
        for i in admitted:
            assert await adm.settle(Reservation("t1", f"r{i}", 300, budget_key), 100)
        assert await adm.budget_state("t1", "p") == (300, 0)
        assert (await _admit(adm, "r-next", 300, budget=1000))[0] == 0
        return admitted
    run(body, redis_server)


def test_settle_is_idempotent(redis_server):
    async def body(client):
        adm = Admission(client)
        assert (await _admit(adm, "a", 50, budget=100))[0] == 0
        r = Reservation("t1", "a", 50, keys("t1", "p")[3])
        assert await adm.settle(r, 40) is True
        assert await adm.settle(r, 40) is False  # a retried settle charges nothing twice
        assert await adm.budget_state("t1", "p") == (40, 0)
    run(body, redis_server)


def test_request_rate_limit_refuses_with_a_retry_delay(redis_server):
    async def body(client):
        adm = Admission(client)
        codes = [(await _admit(adm, f"r{i}", 1, rpm=60))[0] for i in range(11)]
        assert codes[:10] == [0] * 10 and codes[10] == 1  # a burst of 10 seconds' worth
        code, wait = await _admit(adm, "again", 1, rpm=60)
        assert code == 1 and 0 < wait <= 1.0  # one request per second refills
        # Another tenant is unaffected.
        assert (await _admit(adm, "other", 1, tenant="t2", rpm=60))[0] == 0
    run(body, redis_server)


def test_token_rate_limit_counts_tokens(redis_server):
    async def body(client):
        adm = Admission(client)
        assert (await _admit(adm, "a", 600, tpm=1000))[0] == 0
        code, wait = await _admit(adm, "b", 600, tpm=1000)
        assert code == 2 and 10 <= wait <= 13  # 200 tokens missing at 1000/60 per second
        assert (await _admit(adm, "c", 300, tpm=1000))[0] == 0
    run(body, redis_server)


def test_concurrency_cap_and_release(redis_server):
    async def body(client):
        adm = Admission(client)
        assert [(await _admit(adm, f"r{i}", 1, max_concurrent=2))[0] for i in range(3)] == [0, 0, 3]
        await adm.settle(Reservation("t1", "r0", 1, ""), 1)
        assert (await _admit(adm, "r3", 1, max_concurrent=2))[0] == 0
    run(body, redis_server)


def test_a_refused_check_changes_nothing(redis_server):
    async def body(client):
        adm = Admission(client)
        assert (await _admit(adm, "a", 10, rpm=100, max_concurrent=5, budget=15))[0] == 0
        assert (await _admit(adm, "b", 10, rpm=100, max_concurrent=5, budget=15))[0] == 4
        # The refused request took no concurrency slot and no budget.
        assert await client.zcard(keys("t1", "p")[2]) == 1
        assert await adm.budget_state("t1", "p") == (0, 10)
    run(body, redis_server)


def test_admit_and_enqueue_is_all_or_nothing(redis_server):
    """One round trip admits, claims the id, checks the queue bound and enqueues. A refusal of
    any kind writes nothing: no entry, no claim, no reservation."""
    async def enqueue(adm, rid, max_len=3, **limits):
        return await adm.admit_and_enqueue(
            claim_key=f"claim:{rid}", claim_value="t1", claim_ttl_s=60, stream="q", max_len=max_len,
            fields={"d": rid}, tenant_id="t1", request_id=f"{rid}#x", period="p",
            period_end_s=4e9, tokens=100, lease_s=60, **{**UNLIMITED, **limits})

    async def body(client):
        adm = Admission(client)
        assert await enqueue(adm, "a", budget=250) == (0, 0)
        assert [f for _, f in await client.xrange("q")] == [{"d": "a"}]
        assert await client.get("claim:a") == "t1"
        assert await adm.budget_state("t1", "p") == (0, 100)
        # The same id again: refused before admission reserves anything.
        assert (await enqueue(adm, "a", budget=250))[0] == ALREADY_USED
        assert await adm.budget_state("t1", "p") == (0, 100)
        # Over budget: refused, nothing claimed or queued.
        assert (await enqueue(adm, "b", budget=150))[0] == 4
        assert not await client.exists("claim:b") and await client.xlen("q") == 1
        # The queue bound: full at 1 entry, refused with a delay, nothing reserved or claimed.
        code, retry_s = await enqueue(adm, "c", max_len=1, budget=250)
        assert code == QUEUE_FULL and retry_s > 0
        assert not await client.exists("claim:c") and await client.xlen("q") == 1
        assert await adm.budget_state("t1", "p") == (0, 100)
        # After a Redis restart forgets its scripts, the call reloads it itself.
        await client.script_flush()
        assert await enqueue(adm, "d", budget=250) == (0, 0)
        assert await client.xlen("q") == 2
    run(body, redis_server)
