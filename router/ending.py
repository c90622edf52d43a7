"""A request's end event and its bill, written only while this router still holds its entry.

One script checks that the queue entry is pending to this router's consumer and, in the same
atomic step, appends the final (or error) event to the result stream and the bill to
`llmmesh:billing`. Two cases it refuses, where a plain MULTI/EXEC wrote on:

- Redis restarted without its data: the entry (and its group) are gone, its gateway told the
  client UNAVAILABLE and bills what the client received (gateway.frontend). A final written into
  the new Redis billed the whole request a second time, or billed tokens nobody got (chaos Q2).
- another router took the entry over (this one stalled past --claim-idle-ms): the new owner ends
  it, from what the result stream holds; two finals, and two bills, are one too many.
"""
from __future__ import annotations

import enum

import redis.asyncio as aioredis

from llmmesh import billing, queue

# KEYS: 1 queue stream, 2 result stream, 3 billing stream
# ARGV: 1 group, 2 entry id, 3 consumer, 4 number of event fields (pairs) n, 5.. the event's
#       field/value pairs, then the bill's field/value pairs (none: no bill)
_END = """
local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if not ok then
  local msg = type(pending) == 'table' and pending.err or tostring(pending)
  if string.find(msg, 'NOGROUP', 1, true) then return 0 end   -- Redis lost its data
  return redis.error_reply(msg)                -- anything else is not an answer: raise it
end
if #pending == 0 then return 0 end             -- the entry is gone (or acknowledged)
if pending[1][2] ~= ARGV[3] then return -1 end -- another router took it over
local n = tonumber(ARGV[4])
if n > 0 then
  local event = {}
  for i = 5, 4 + 2 * n do event[#event + 1] = ARGV[i] end
  redis.call('XADD', KEYS[2], '*', unpack(event))
end
if #ARGV > 4 + 2 * n then
  local bill = {}
  for i = 5 + 2 * n, #ARGV do bill[#bill + 1] = ARGV[i] end
  redis.call('XADD', KEYS[3], '*', unpack(bill))
end
return 1
"""


# Renews this router's hold on its entries (XCLAIM to itself resets the idle clock other routers
# watch), and only on those still its own: a plain XCLAIM of every held id took back, after a
# stall, entries another router had taken over, and the two then swapped them at every beat.
# KEYS: 1 queue stream; ARGV: 1 group, 2 consumer, 3.. entry ids. Returns the ids that are no
# longer this consumer's (gone, or another's).
_RENEW = """
local lost = {}
for i = 3, #ARGV do
  local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if ok and #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""


class Ended(enum.IntEnum):
    """What the end script did."""

    WRITTEN = 1
    ENTRY_GONE = 0       # Redis lost its data (or the entry was acknowledged already)
    TAKEN_OVER = -1      # another router's consumer holds the entry now


def _pairs(fields: dict[str, str] | None) -> list[str]:
    return [x for k, v in (fields or {}).items() for x in (k, v)]


class EndScripts:
    """The two scripts, registered once per Redis client (EVALSHA; reloaded after a restart)."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._end = redis.register_script(_END)
        self._renew = redis.register_script(_RENEW)

    async def write_end(self, *, request_class: str, entry_id: str, consumer: str,
                        request_id: str, event: dict[str, str] | None,
                        bill: dict[str, str] | None) -> Ended:
        """Appends `event` to the request's result stream and `bill` to the billing stream
        (either may be None), atomically and only while `consumer` holds the entry."""
        event_args = _pairs(event)
        reply = await self._end(
            keys=[queue.queue_stream(request_class), queue.result_stream(request_id),
                  billing.BILLING_STREAM],
            args=[queue.ROUTER_GROUP, entry_id, consumer, len(event_args) // 2, *event_args,
                  *_pairs(bill)])
        return Ended(int(reply))

    async def renew(self, *, request_class: str, consumer: str, entry_ids: list[str]) -> list[str]:
        """Heartbeats `entry_ids` that are still `consumer`'s; returns the others."""
        if not entry_ids:
            return []
        return list(await self._renew(keys=[queue.queue_stream(request_class)],
                                      args=[queue.ROUTER_GROUP, consumer, *entry_ids]))
