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
if not ok then return 0 end                    -- NOGROUP: Redis lost its data
if #pending == 0 then return 0 end             -- the entry is gone
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


class Ended(enum.IntEnum):
    """What the end script did."""

    WRITTEN = 1
    ENTRY_GONE = 0       # Redis lost its data (or the entry was acknowledged already)
    TAKEN_OVER = -1      # another router's consumer holds the entry now


def _pairs(fields: dict[str, str] | None) -> list[str]:
    return [x for k, v in (fields or {}).items() for x in (k, v)]


async def write_end(redis: aioredis.Redis, *, request_class: str, entry_id: str, consumer: str,
                    request_id: str, event: dict[str, str] | None,
                    bill: dict[str, str] | None) -> Ended:
    """Appends `event` to the request's result stream and `bill` to the billing stream (either
    may be None), atomically and only while `consumer` holds the entry."""
    event_args = _pairs(event)
    reply = await redis.eval(
        _END, 3, queue.queue_stream(request_class), queue.result_stream(request_id),
        billing.BILLING_STREAM, queue.ROUTER_GROUP, entry_id, consumer, len(event_args) // 2,
        *event_args, *_pairs(bill))
    return Ended(int(reply))
