"""Redis key names and the codecs of queue entries and result-stream events.

Every service that touches Redis uses these names, so they live in one place. Keys that
belong to one request are hash-tagged by request id so multi-key scripts stay on one
Redis Cluster slot.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field, fields
from typing import Any

from redis.exceptions import ResponseError

from llmmesh import streamauth
from llmmesh.vocab import CLASSES

PREFIX = "llmmesh"
ROUTER_GROUP = "routers"
DEAD_LETTER_STREAM = f"{PREFIX}:q:dead"
# The dead-letter stream keeps about this many records (XADD MAXLEN ~): an operator's view of
# what failed lately, never a store that grows without bound.
DEAD_LETTER_MAXLEN = 10_000
# An entry delivered this many times (XPENDING's count: every router that took it) is dead-lettered.
MAX_DELIVERIES = 3
CANCEL_CHANNEL = f"{PREFIX}:cancel"
WORKER_KEY_PREFIX = f"{PREFIX}:worker:"
# Result streams outlive their request briefly so a reconnecting gateway can still read them.
RESULT_TTL_S = 3600


def queue_stream(request_class: str) -> str:
    if request_class not in CLASSES:
        raise ValueError(f"unknown request class {request_class!r}")
    return f"{PREFIX}:q:{request_class}"


def mesh_request_id(tenant_id: str, client_request_id: str) -> str:
    """The id a request carries inside the mesh: its queue entry, result stream, cancel key and
    ledger row. Scoped by tenant and unique per admission, so two tenants' equal ids never meet
    and an id reused after its claim expired is a new request, billed anew."""
    return f"{tenant_id}/{client_request_id}/{secrets.token_hex(6)}"


def claim_key(tenant_id: str, client_request_id: str) -> str:
    """Held while a client's request id is in use (its value: the mesh request id); per tenant,
    so no tenant learns which ids another uses."""
    return f"{PREFIX}:req:{{{tenant_id}/{client_request_id}}}"


def result_stream(request_id: str) -> str:
    return f"{PREFIX}:res:{{{request_id}}}"


def cancel_key(request_id: str) -> str:
    return f"{PREFIX}:cancel:{{{request_id}}}"


def worker_key(worker_id: str) -> str:
    return f"{WORKER_KEY_PREFIX}{worker_id}"


def worker_cache_key(worker_id: str) -> str:
    """Set of the prefix-block hashes a worker reports as cached (the shared affinity index)."""
    return f"{PREFIX}:cache:{worker_id}"


@dataclass(slots=True)
class QueueEntry:
    """Everything the router and worker need, written once by the gateway."""

    request_id: str
    tenant_id: str
    request_class: str
    model: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    cache_salt: str
    block_hashes: list[int]
    deadline_unix_ns: int = 0
    enqueued_unix_ns: int = 0
    traceparent: dict[str, str] = field(default_factory=dict)
    # llmmesh.admission.Reservation as a dict: settled by whoever ends the request.
    reservation: dict[str, Any] = field(default_factory=dict)
    # Set for requests of a batch job: where the router records the outcome.
    job_id: str = ""
    job_index: int = -1
    # gen_ai.operation.name: "chat" (messages) or "text_completion" (a raw prompt).
    operation: str = "text_completion"
    # The request's result-stream secret (llmmesh.streamauth): drawn by the gateway, read by
    # routers, never given to a worker.
    stream_key: str = ""

    def encode(self) -> dict[str, str]:
        # A shallow dict: the values are plain JSON already (dataclasses.asdict deep-copies
        # them, ~40 us per request on the gateway's path to the queue).
        return {"d": json.dumps({f: getattr(self, f) for f in _ENTRY_FIELDS}, separators=(",", ":"))}

    @classmethod
    def decode(cls, fields: dict) -> "QueueEntry":
        raw = fields.get("d") or fields.get(b"d")
        body = json.loads(raw)
        # A field this version does not know (a newer gateway, mid rolling upgrade) is left
        # out, not fatal; a missing one takes its default.
        return cls(**{k: v for k, v in body.items() if k in _ENTRY_FIELD_SET})


_ENTRY_FIELDS = tuple(f.name for f in fields(QueueEntry))
_ENTRY_FIELD_SET = frozenset(_ENTRY_FIELDS)


def dead_letter_record(*, entry_id: str, request_class: str, reason: str,
                       entry: QueueEntry | None = None, deliveries: int = 0) -> dict[str, str]:
    """What the dead-letter stream keeps of a failed entry: who, which model, why — never the
    prompt (its tokens are the prompt's text) or the sampling parameters."""
    record = {"entry_id": entry_id, "class": request_class, "reason": reason[:500],
              "deliveries": str(deliveries)}
    if entry is not None:
        record.update(request_id=entry.request_id, tenant_id=entry.tenant_id, model=entry.model,
                      num_prompt_tokens=str(len(entry.prompt_token_ids)))
    return record


async def dead_letter(redis, record: dict[str, str]) -> None:
    await redis.xadd(DEAD_LETTER_STREAM, record, maxlen=DEAD_LETTER_MAXLEN, approximate=True)


def tokens_event(index: int, token_ids: list[int], logprobs: list[float] | None = None,
                 end: dict[str, Any] | None = None, attempt: int | None = None,
                 key: bytes | None = None) -> dict[str, str]:
    """A chunk of tokens starting at completion index `index`. `end` marks a worker's last chunk
    (it may hold no tokens): {"finish_reason", "usage"} of the attempt, so a router that takes the
    request over knows it ended even if the worker's final message never reached a router.
    `attempt` and `key`: the attempt that writes it and its key (llmmesh.streamauth), which signs it."""
    body: dict[str, Any] = {"kind": "tokens", "index": index, "ids": token_ids}
    if logprobs:
        body["logprobs"] = logprobs
    if end:
        body["end"] = end
    if attempt is not None:
        body["a"] = attempt
    return streamauth.signed(json.dumps(body, separators=(",", ":")), key)


class IndexTaken(Exception):
    """A token event for this completion index (or a later one, or the final) is already in the
    result stream: the writer is an attempt that was replaced and must stop."""


def token_entry_id(index: int) -> str:
    """The result-stream entry id of the token event starting at completion index `index`.

    Token events carry explicit increasing ids, so Redis itself refuses a second writer of an
    index (a worker that has not yet noticed it was replaced); final and error events take
    automatic ids (milliseconds since 1970), which sort after every token id, so nothing can be
    appended after them either.
    """
    return f"0-{index + 1}"


async def append_tokens(redis, stream: str, index: int, token_ids: list[int],
                        logprobs: list[float] | None = None, end: dict[str, Any] | None = None,
                        attempt: int | None = None, key: bytes | None = None) -> None:
    """XADD one token event at its index's entry id; IndexTaken when that id is used up."""
    try:
        await redis.xadd(stream, tokens_event(index, token_ids, logprobs, end, attempt, key),
                         id=token_entry_id(index))
    except ResponseError as exc:
        if "equal or smaller" not in str(exc):
            raise
        raise IndexTaken(f"{stream}: completion index {index} was already delivered") from exc


def final_event(finish_reason: str, usage: dict[str, Any], key: bytes | None = None,
                bill: str | None = None) -> dict[str, str]:
    """The request's end, written by its router; `key`: the router's key (llmmesh.streamauth).
    `bill`: the request's billing record as written to the billing stream (its "d" field), for
    its gateway to keep and write again should Redis lose it unshipped (llmmesh.billing)."""
    body: dict[str, Any] = {"kind": "final", "finish_reason": finish_reason, "usage": usage}
    if bill is not None:
        body["bill"] = bill
    return streamauth.signed(json.dumps(body), key)


def error_event(code: str, message: str, key: bytes | None = None) -> dict[str, str]:
    return streamauth.signed(json.dumps({"kind": "error", "code": code, "message": message}), key)


def decode_event(fields: dict) -> dict[str, Any]:
    raw = fields.get("d") or fields.get(b"d")
    return json.loads(raw)
