"""Batch jobs in Redis: the job hash, its results stream, and the one write that records an
item's outcome. The gateway creates jobs and reads them; the router records outcomes, so a
job keeps progressing while no gateway is up, and survives gateway restarts.
"""
from __future__ import annotations

import json

import redis.asyncio as aioredis

from llmmesh.queue import PREFIX

DEFAULT_RESULTS_TTL_S = 7 * 86400


def job_key(job_id: str) -> str:
    return f"{PREFIX}:job:{{{job_id}}}"


def job_results_key(job_id: str) -> str:
    return f"{PREFIX}:job:{{{job_id}}}:results"


# KEYS: 1 job hash, 2 results stream; ARGV: 1 index, 2 result json, 3 ok(1)/failed(0),
# 4 prompt tokens, 5 completion tokens. An index is recorded once, even if a router retries.
_RECORD = """
if redis.call('HSETNX', KEYS[1], 'done:' .. ARGV[1], 1) == 0 then return 0 end
redis.call('XADD', KEYS[2], '*', 'd', ARGV[2])
if ARGV[3] == '1' then redis.call('HINCRBY', KEYS[1], 'num_completed', 1)
else redis.call('HINCRBY', KEYS[1], 'num_failed', 1) end
redis.call('HINCRBY', KEYS[1], 'prompt_tokens', tonumber(ARGV[4]))
redis.call('HINCRBY', KEYS[1], 'completion_tokens', tonumber(ARGV[5]))
local ttl = redis.call('TTL', KEYS[1])
if ttl > 0 then redis.call('EXPIRE', KEYS[2], ttl) end
return 1
"""


class JobResults:
    def __init__(self, redis: aioredis.Redis):
        self._record = redis.register_script(_RECORD)

    async def record(self, job_id: str, index: int, request_id: str, *, token_ids: list[int],
                     finish_reason: str = "", usage: dict | None = None, error_code: str = "",
                     error_message: str = "", model: str = "") -> bool:
        usage = usage or {}
        # The model goes with the tokens: only its tokenizer can turn them into text.
        body = {"index": index, "request_id": request_id, "token_ids": token_ids,
                "model": model, "finish_reason": finish_reason, "usage": usage,
                "error_code": error_code, "error_message": error_message}
        return bool(await self._record(
            keys=[job_key(job_id), job_results_key(job_id)],
            args=[index, json.dumps(body), 0 if error_code else 1,
                  usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)]))
