"""What the gateway does for bills when Redis loses its data: it alone saw what reached clients.

A Redis that restarts empty takes with it the queue entries of requests in flight and the bills
waiting to be shipped. For the first, the gateway tells its client UNAVAILABLE and bills exactly
the tokens it relayed (their routers' ends are refused: router.ending); for the second, it keeps
the bill every final carries and writes them all again when the epoch changes (llmmesh.epoch).
The ledger is keyed by request id and keeps the first record of each, so writing one again
never bills twice.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from llmmesh import billing, queue
from llmmesh.epoch import RedisEpoch

log = logging.getLogger("gateway.losses")
T = TypeVar("T")
# A lost request's bill that Redis would not take (still restarting) is tried again this long.
_BILL_RETRY_S = 60.0


class LossKeeper:
    def __init__(self, redis: aioredis.Redis, recent: billing.RecentBills | None = None) -> None:
        self.redis = redis
        self.epoch = RedisEpoch(redis)
        self.recent = recent or billing.RecentBills()
        self._retries: set[asyncio.Task] = set()

    async def watch(self) -> None:
        """Loop (supervised): bills kept from finals written again after each wipe."""
        await self.epoch.watch(lambda: self.recent.replay(self.redis))

    def finished(self, request_id: str, bill: str | None) -> None:
        """A final reached the client: keep the bill it carried (its "d" field)."""
        if bill:
            self.recent.remember(request_id, {"d": bill})

    async def bill_lost(self, entry: queue.QueueEntry, num_delivered: int) -> None:
        """Bills what the client of a request lost with Redis's data received (nothing when it
        received no token: like a router's error, a prompt alone is not billed)."""
        if not num_delivered:
            return
        fields = billing.lost_request_record(
            request_id=entry.request_id, tenant_id=entry.tenant_id, model=entry.model,
            request_class=entry.request_class, operation=entry.operation,
            num_prompt_tokens=len(entry.prompt_token_ids), num_delivered_tokens=num_delivered,
            enqueued_unix_ns=entry.enqueued_unix_ns)
        self.recent.remember(entry.request_id, fields)
        try:
            await self.redis.xadd(billing.BILLING_STREAM, fields)
        except RedisError:
            self._later(self._bill_when_back(fields))

    def check_lost_later(self, entry: queue.QueueEntry, claim: str, num_delivered: int) -> None:
        """A call given up during a long outage: once Redis answers, bill what its client got
        if the request's claim is gone (Redis came back without it); else its router ends it."""
        self._later(self._check_when_back(entry, claim, num_delivered))

    def _later(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)

    async def _check_when_back(self, entry: queue.QueueEntry, claim: str, num_delivered: int) -> None:
        owner = await when_back(lambda: self.redis.get(claim), _BILL_RETRY_S)
        if owner is NOT_BACK or owner == entry.request_id:
            return      # never answered, or it survived: its router ends and bills it
        log.error("request %s: lost with Redis's data after its client gave up waiting; "
                  "billing the %d tokens it received", entry.request_id, num_delivered)
        await self.bill_lost(entry, num_delivered)

    async def _bill_when_back(self, fields: dict[str, str]) -> None:
        if await when_back(lambda: self.redis.xadd(billing.BILLING_STREAM, fields),
                           _BILL_RETRY_S) is NOT_BACK:
            # Still remembered: the next replay writes it, if Redis is wiped again.
            log.error("a lost request's bill could not be written within %.0f s", _BILL_RETRY_S)


NOT_BACK = object()


async def when_back(action: Callable[[], Awaitable[T]], within_s: float,
                    interval_s: float = 0.5) -> T | object:
    """`action()`'s result once Redis answers it, tried every `interval_s` for `within_s`;
    NOT_BACK if it never did."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        await asyncio.sleep(interval_s)
        with contextlib.suppress(RedisError):
            return await action()
    return NOT_BACK
