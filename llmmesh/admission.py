"""Admission in Redis: rate limits, concurrency caps and token budgets in one atomic script.

The gateway admits (reserving the request's worst-case tokens against the budget) and the
router settles when the request ends (releasing the reservation, charging what was used).
Checking and reserving in one script means concurrent bursts can never overshoot a budget:
LiteLLM-style after-the-fact accounting lets every in-flight request through.

Every key of one tenant carries the hash tag {tenant} so the admission script runs on one
Cluster slot. The gateway runs it inside a larger script that also claims the request id and
enqueues (one round trip before a router can see the request); that one wants a single node.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import redis.asyncio as aioredis

from llmmesh.queue import PREFIX

# KEYS: 1 request bucket, 2 token bucket, 3 concurrency zset, 4 budget hash
# ARGV: 1 rpm, 2 tpm, 3 max_concurrent, 4 budget, 5 tokens needed, 6 request id,
#       7 lease seconds, 8 budget period end (unix s)
# Limits of 0 mean "no limit". Returns {code, retry_after_ms}; code 0 = admitted.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local max_conc, budget = tonumber(ARGV[3]), tonumber(ARGV[4])
local need, lease = tonumber(ARGV[5]), tonumber(ARGV[7])

local function bucket(key, per_minute, cost, capacity)
  if per_minute <= 0 then return true, 0, nil end
  local rate = per_minute / 60.0
  local s = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens = tonumber(s[1]) or capacity
  local ts = tonumber(s[2]) or now
  tokens = math.min(capacity, tokens + (now - ts) * rate)
  if tokens >= cost then return true, 0, tokens - cost end
  return false, math.ceil((cost - tokens) / rate * 1000), nil
end

-- Requests may burst 10 seconds' worth (a minute's worth at once would let one tenant flood
-- the fleet for a moment); tokens keep a minute's worth so one large request always fits.
local ok, wait, req_left = bucket(KEYS[1], rpm, 1, math.max(1, math.ceil(rpm / 6)))
if not ok then return {1, wait} end
local ok2, wait2, tok_left = bucket(KEYS[2], tpm, need, tpm)
if not ok2 then return {2, wait2} end
if max_conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= max_conc then return {3, 500} end
end
if budget > 0 then
  local b = redis.call('HMGET', KEYS[4], 'used', 'reserved')
  local used, reserved = tonumber(b[1]) or 0, tonumber(b[2]) or 0
  if used + reserved + need > budget then
    return {4, math.max(1000, math.ceil((tonumber(ARGV[8]) - now) * 1000))}
  end
end
-- Every check passed: apply them all.
if req_left then redis.call('HSET', KEYS[1], 'tokens', req_left, 'ts', now); redis.call('EXPIRE', KEYS[1], 120) end
if tok_left then redis.call('HSET', KEYS[2], 'tokens', tok_left, 'ts', now); redis.call('EXPIRE', KEYS[2], 120) end
if max_conc > 0 then redis.call('ZADD', KEYS[3], now + lease, ARGV[6]) end
if budget > 0 then
  redis.call('HINCRBY', KEYS[4], 'reserved', need)
  redis.call('EXPIREAT', KEYS[4], math.floor(tonumber(ARGV[8])) + 86400)
end
return {0, 0}
"""

# Settlements are remembered this long (marker and index): the reconciler's reach back.
SETTLED_TTL_S = 86400

# KEYS: 1 concurrency zset, 2 settled marker, 3 the tenant's settlement index, 4 budget hash
#       (optional)
# ARGV: 1 reservation id, 2 reserved, 3 used, 4 the mesh request id, 5 SETTLED_TTL_S
# The index (score: settle time in ms, member "<used> <request id>") is what lets the
# reconciler (costd.reconcile) find a window's settlements and the tokens each charged,
# without scanning every marker.
_SETTLE = """
redis.call('ZREM', KEYS[1], ARGV[1])
local ttl = tonumber(ARGV[5])
-- A settle retried after a router restart must not charge twice.
if not redis.call('SET', KEYS[2], ARGV[3], 'NX', 'EX', ttl) then return 0 end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[3], now_ms, ARGV[3] .. ' ' .. ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms - ttl * 1000)
redis.call('EXPIRE', KEYS[3], ttl)
if #KEYS >= 4 and redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('HINCRBY', KEYS[4], 'reserved', -tonumber(ARGV[2]))
  redis.call('HINCRBY', KEYS[4], 'used', tonumber(ARGV[3]))
end
return 1
"""

# Admission, the request id's claim, the queue bound and the enqueue, in one atomic script: the
# gateway's only round trip before a router can see the request (each extra round trip on this
# path costs the request's TTFT a Redis wake-up, ~0.2-0.5 ms on a shared VM). Its keys span
# slots (tenant, request id, queue), so it wants one Redis node, not a Cluster.
# KEYS: 1-4 as _ADMIT, 5 request-id claim, 6 queue stream
# ARGV: 1-8 as _ADMIT, 9 claim value (tenant), 10 claim ttl s, 11 queue bound, 12... the entry's
#       field, value pairs
# Returns {code, retry_after_ms}: 0 enqueued, 1-4 as _ADMIT, 5 id already used, 6 queue full.
# Nothing is written unless every check passes.
_ADMIT_AND_ENQUEUE = """
if redis.call('EXISTS', KEYS[5]) == 1 then return {5, 0} end
if redis.call('XLEN', KEYS[6]) >= tonumber(ARGV[11]) then return {6, 2000} end
local function admit()
""" + _ADMIT + """
end
local r = admit()
if r[1] ~= 0 then return r end
redis.call('SET', KEYS[5], ARGV[9], 'EX', tonumber(ARGV[10]))
redis.call('XADD', KEYS[6], '*', unpack(ARGV, 12))
return {0, 0}
"""
ALREADY_USED, QUEUE_FULL = 5, 6

REFUSALS = {1: "requests-per-minute limit", 2: "tokens-per-minute limit",
            3: "concurrent-request limit", 4: "token budget for this period"}


@dataclass(slots=True)
class Reservation:
    """What admission took, carried in the queue entry so whoever ends the request settles it."""

    tenant_id: str
    request_id: str      # the reservation's own id (the gateway suffixes the request id)
    reserved_tokens: int
    budget_key: str  # empty when the tenant has no budget

    def to_dict(self) -> dict:
        return asdict(self)


def keys(tenant_id: str, period: str) -> list[str]:
    tag = f"{{{tenant_id}}}"
    return [f"{PREFIX}:rl:{tag}:req", f"{PREFIX}:rl:{tag}:tok", f"{PREFIX}:conc:{tag}",
            f"{PREFIX}:budget:{tag}:{period}"]


SETTLEMENTS_PREFIX = f"{PREFIX}:settlements:"


def settlement_index_key(tenant_id: str) -> str:
    return f"{SETTLEMENTS_PREFIX}{{{tenant_id}}}"


@dataclass(frozen=True, slots=True)
class Settlement:
    """One settled admission, as the settlement index remembers it."""

    tenant_id: str
    request_id: str
    used_tokens: int       # prompt + delivered completion tokens; 0: ended unbilled
    settled_unix_ms: int   # Redis's clock


async def read_settlements(redis: aioredis.Redis, since_unix_ms: int) -> list[Settlement]:
    """Every tenant's settlements from `since_unix_ms` on (as far back as SETTLED_TTL_S)."""
    found: list[Settlement] = []
    async for key in redis.scan_iter(match=f"{SETTLEMENTS_PREFIX}*", count=1000):
        key = key.decode() if isinstance(key, bytes) else key
        tenant_id = key[len(SETTLEMENTS_PREFIX):].removeprefix("{").removesuffix("}")
        for member, score in await redis.zrangebyscore(key, since_unix_ms, "+inf",
                                                       withscores=True):
            member = member.decode() if isinstance(member, bytes) else member
            used, _, request_id = member.partition(" ")
            found.append(Settlement(tenant_id, request_id, int(used), int(score)))
    return found


def _admit_keys_args(*, tenant_id: str, request_id: str, rpm: int, tpm: int,
                     max_concurrent: int, budget: int, period: str, period_end_s: float,
                     tokens: int, lease_s: float) -> tuple[list, list]:
    """_ADMIT's KEYS and ARGV, in the order its header names them."""
    return keys(tenant_id, period), [rpm, tpm, max_concurrent, budget, tokens, request_id,
                                     lease_s, period_end_s]


class Admission:
    def __init__(self, redis: aioredis.Redis):
        self._redis = redis
        self._admit = redis.register_script(_ADMIT)
        self._settle = redis.register_script(_SETTLE)
        self._enqueue = redis.register_script(_ADMIT_AND_ENQUEUE)

    async def admit(self, **admit_args) -> tuple[int, float]:
        """(0, 0) when admitted, else (reason code, retry-after seconds). Arguments as
        _admit_keys_args."""
        keys_, args = _admit_keys_args(**admit_args)
        # Through the registered script, which reloads it itself after a Redis restart.
        return self._outcome(await self._admit(keys=keys_, args=args))

    async def admit_and_enqueue(self, *, claim_key: str, claim_value: str, claim_ttl_s: int,
                                stream: str, max_len: int, fields: dict[str, str],
                                **admit_args) -> tuple[int, float]:
        """Admit (as admit()), claim the request id, check the queue bound and XADD `fields`
        to `stream`, all or nothing, in one round trip. (0, 0) when enqueued, else (code,
        retry-after seconds): 1-4 REFUSALS, ALREADY_USED, QUEUE_FULL."""
        keys_, args = _admit_keys_args(**admit_args)
        # The registered script reloads itself after a Redis restart (NOSCRIPT).
        return self._outcome(await self._enqueue(
            keys=[*keys_, claim_key, stream],
            args=[*args, claim_value, claim_ttl_s, max_len,
                  *(x for pair in fields.items() for x in pair)]))

    @staticmethod
    def _outcome(reply) -> tuple[int, float]:
        code, wait_ms = reply
        return int(code), int(wait_ms) / 1000.0

    async def settle(self, r: Reservation, used_tokens: int, request_id: str = "") -> bool:
        """Release the reservation and charge `used_tokens`; idempotent per request.
        `request_id` is the mesh request id its bill carries (default: the reservation id up
        to the gateway's '#' suffix)."""
        tag = f"{{{r.tenant_id}}}"
        settle_keys = [f"{PREFIX}:conc:{tag}", f"{PREFIX}:settled:{tag}:{r.request_id}",
                       settlement_index_key(r.tenant_id)]
        if r.budget_key:
            settle_keys.append(r.budget_key)
        return bool(await self._settle(
            keys=settle_keys, args=[r.request_id, r.reserved_tokens, used_tokens,
                                    request_id or r.request_id.partition("#")[0], SETTLED_TTL_S]))

    async def budget_state(self, tenant_id: str, period: str) -> tuple[int, int]:
        """(used, reserved) tokens of a tenant's budget period."""
        raw = await self._redis.hmget(keys(tenant_id, period)[3], "used", "reserved")
        return int(raw[0] or 0), int(raw[1] or 0)
