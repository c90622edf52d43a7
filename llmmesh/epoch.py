"""Tells a Redis that lost its data from one that merely restarted on it.

A run id changes on every restart, append-only file or not, so it cannot tell the two apart;
a key can. The first service to find `llmmesh:epoch` missing writes a random value there (SET NX,
one round trip with GET); every service remembers the value it saw, and a different one later
means Redis came back without its data. What the services then do is theirs: the routers drop
the entries they had read (their gateways told the clients UNAVAILABLE), the gateways and the
routers write again the bills they remember (llmmesh.billing.RecentBills), since the bills that
waited in Redis to be shipped are gone.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from llmmesh import queue

EPOCH_KEY = f"{queue.PREFIX}:epoch"
# How often a service looks; bounds how late a wipe is noticed (chaos Q2: within 2 s).
WATCH_INTERVAL_S = 0.5

log = logging.getLogger("llmmesh.epoch")


class RedisEpoch:
    """The epoch this process last saw, and how many wipes it has seen (`generation`)."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.value: str | None = None
        self.generation = 0

    async def observe(self) -> bool:
        """Reads the epoch, founding it if missing; True when it changed since the last read
        (Redis lost its data meanwhile). Raises RedisError while Redis is down."""
        mine = secrets.token_hex(8)
        before = await self.redis.set(EPOCH_KEY, mine, nx=True, get=True)
        current = mine if before is None else (before.decode() if isinstance(before, bytes) else before)
        changed = self.value is not None and current != self.value
        self.value = current
        if changed:
            self.generation += 1
        return changed

    async def watch(self, on_lost: Callable[[], Awaitable[None]],
                    interval_s: float = WATCH_INTERVAL_S) -> None:
        """Loop: observe every `interval_s`; on a change, log it and await `on_lost()`."""
        recovering = False
        while True:
            try:
                if await self.observe():
                    log.error("Redis lost its data (restarted without it: epoch %s is new); "
                              "recovering what this process can", self.value)
                    recovering = True
                if recovering:   # again on the next round if Redis failed under it
                    await on_lost()
                    recovering = False
            except RedisError:
                pass    # down: the health check says so; looked at again when it is back
            await asyncio.sleep(interval_s)
