"""Runs one queued request on workers until it ends; its tokens reach its result stream.

Workers append tokens to the request's result stream themselves (the router names it), so the
router sees only each attempt's final message. A worker that dies mid-stream is replaced: the
router reads what the stream holds, and the next attempt's prompt is the original prompt plus
those tokens, numbered on from there, so the client sees no duplicate and no gap. Token events
sit at entry ids fixed by their index (llmmesh.queue.token_entry_id), so Redis refuses a
replaced attempt that writes on.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc
import redis.asyncio as aioredis
from opentelemetry import trace

from llmmesh import billing, queue, streamauth, telemetry, vocab
from llmmesh.v1 import common_pb2, worker_pb2
from llmmesh.vocab import FinishReason, RequestClass
from router.registry import WorkerHandle

log = logging.getLogger("router.relay")

MAX_ATTEMPTS = 3
# A worker's attempt ends this long before the request's deadline, so the last token it appends
# still reaches the client before the client's own deadline ends the call. Without it, tokens a
# worker appended in the deadline's last milliseconds were in the result stream, so billed, but
# never read by a client already gone (chaos F2: 3 of 200 requests billed 1 token too many).
# 20 ms was not enough with the whole suite on two cores (F2 in `make test`, 2026-12-03: 1 of 40
# billed a token its client never got, the gateway's relay lagging): 50 ms.
WORKER_DEADLINE_MARGIN_NS = 50_000_000
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.ABORTED}


class RequestFailed(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class RequestProgress:
    """What has been delivered so far, across attempts."""

    entry: queue.QueueEntry
    delivered: list[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    prefill_device_s: float = 0.0
    decode_device_s: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0   # the first attempt's: the wall time its prefill took
    attempts: int = 0
    # Which delivery of its queue entry this router holds (1: fresh; XPENDING's count when taken
    # over): attempt numbers are unique across routers (llmmesh.streamauth.attempt_number).
    delivery: int = 1
    worker_ids: list[str] = field(default_factory=list)
    cancelled: bool = False
    # Set for an entry delivered more than queue.MAX_DELIVERIES times (routers kept dying with
    # it, or it kills them): it ends in UNAVAILABLE instead of running again.
    give_up: str | None = None
    # Set when the result stream shows the request already ended on a worker (its last chunk
    # carries an end marker) or holds all max_tokens: nothing is left to run, only to finish.
    end_reason: str | None = None

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.entry.prompt_token_ids),
                "cached_prompt_tokens": self.cached_prompt_tokens,
                "completion_tokens": len(self.delivered),
                "prefill_device_s": self.prefill_device_s, "decode_device_s": self.decode_device_s,
                "queue_s": self.queue_s, "prefill_s": self.prefill_s}


    def attempt(self) -> int:
        """The number of the attempt about to run (or running)."""
        return streamauth.attempt_number(self.delivery, self.attempts)

    def attempt_key(self) -> bytes | None:
        return streamauth.attempt_key(self.entry.stream_key, self.attempt()) \
            if self.entry.stream_key else None

    def router_key(self) -> bytes | None:
        return streamauth.router_key(self.entry.stream_key) if self.entry.stream_key else None


def read_result_stream(events, entry: queue.QueueEntry) -> tuple[list[int], dict | None, dict | None]:
    """The tokens a result stream holds, in index order, as its client sees them (only events
    their writers may write: llmmesh.streamauth); its final or error event if any; and the end
    marker of a worker's last chunk if any (queue.tokens_event)."""
    check = streamauth.StreamCheck(entry.stream_key, entry.request_id)
    delivered: list[int] = []
    end = None
    for _, fields in events:
        event = check.accept(fields)
        if event is None:
            continue
        if event["kind"] in ("final", "error"):
            return delivered, event, end
        delivered.extend(event["ids"])
        end = event.get("end")
    return delivered, None, end


def apply_stream_state(p: RequestProgress, delivered: list[int], end: dict | None) -> None:
    """Take what the result stream says: the delivered tokens and, when the request in fact
    ended on a worker (whose final message no router received), how it ended."""
    p.delivered = delivered
    if p.end_reason is not None:
        return   # already taken (the marker's usage counts once)
    if end is not None:
        p.end_reason = end["finish_reason"]
        u = end.get("usage", {})
        p.prefill_device_s += u.get("prefill_device_s", 0.0)
        p.decode_device_s += u.get("decode_device_s", 0.0)
        if not p.cached_prompt_tokens:
            p.cached_prompt_tokens = min(u.get("cached_prompt_tokens", 0),
                                         len(p.entry.prompt_token_ids))
        if not p.prefill_s:
            p.prefill_s = u.get("prefill_s", 0.0)
    elif len(delivered) >= p.entry.sampling["max_tokens"]:
        p.end_reason = FinishReason.LENGTH


async def _read_stream(p: RequestProgress, redis: aioredis.Redis):
    return read_result_stream(await redis.xrange(queue.result_stream(p.entry.request_id)), p.entry)


async def sync_delivered(p: RequestProgress, redis: aioredis.Redis) -> None:
    """After an attempt broke off: what its worker appended to the result stream itself."""
    delivered, _, end = await _read_stream(p, redis)
    apply_stream_state(p, delivered, end)


async def _take_verified(p: RequestProgress, redis: aioredis.Redis, reported: int,
                         worker_id: str) -> None:
    delivered, _, _ = await _read_stream(p, redis)
    if len(delivered) != reported:
        log.warning("request %s: worker %s reported %d tokens, its result stream holds %d; "
                    "billing what the stream holds", p.entry.request_id, worker_id, reported,
                    len(delivered))
    p.delivered = delivered


def worker_request(p: RequestProgress) -> worker_pb2.WorkerGenerateRequest:
    e, s = p.entry, p.entry.sampling
    sampling = common_pb2.SamplingParams(
        max_tokens=s["max_tokens"] - len(p.delivered), temperature=s["temperature"],
        top_p=s["top_p"], top_k=s["top_k"], stop=s["stop"], logprobs=s["logprobs"])
    if s.get("seed") is not None:
        sampling.seed = s["seed"]
    return worker_pb2.WorkerGenerateRequest(
        request_id=e.request_id, tenant_id=e.tenant_id, model=e.model,
        prompt_token_ids=e.prompt_token_ids + p.delivered, sampling=sampling,
        request_class=RequestClass(e.request_class).proto, cache_salt=e.cache_salt,
        deadline_unix_ns=_worker_deadline_ns(e), start_index=len(p.delivered),
        num_original_prompt_tokens=len(e.prompt_token_ids),
        result_stream=queue.result_stream(e.request_id), operation=e.operation,
        attempt=p.attempt(), attempt_key=p.attempt_key() or b"")


def queue_wait_s(entry: queue.QueueEntry, sent_unix_ns: int) -> float:
    """Seconds from the gateway's enqueue to the router sending the first attempt."""
    if not entry.enqueued_unix_ns:
        return 0.0
    return max(0, sent_unix_ns - entry.enqueued_unix_ns) / 1e9


def _worker_deadline_ns(entry: queue.QueueEntry) -> int:
    return entry.deadline_unix_ns - WORKER_DEADLINE_MARGIN_NS if entry.deadline_unix_ns else 0


def _timeout_s(entry: queue.QueueEntry) -> float | None:
    if not entry.deadline_unix_ns:
        return None
    return max(0.001, (_worker_deadline_ns(entry) - time.time_ns()) / 1e9)


async def run_attempt(p: RequestProgress, worker: WorkerHandle, redis: aioredis.Redis) -> str | None:
    """One attempt on one worker; returns the finish reason, or None if the stream broke off retryably.

    The worker appends tokens to the result stream itself and reports them in its final message
    (one hop less per token); tokens it sends in the gRPC stream instead are appended here.
    """
    metadata = tuple(telemetry.inject_traceparent().items())
    sent_unix_ns = time.time_ns()
    call = worker.stub.Generate(worker_request(p), timeout=_timeout_s(p.entry), metadata=metadata)
    stream = queue.result_stream(p.entry.request_id)
    attempt, key = p.attempt(), p.attempt_key()
    first = p.attempts == 0
    try:
        async for msg in call:
            if msg.HasField("tokens"):
                ids = list(msg.tokens.token_ids)
                await queue.append_tokens(redis, stream, len(p.delivered), ids,
                                          list(msg.tokens.logprobs), attempt=attempt, key=key)
                p.delivered.extend(ids)
            else:
                if msg.final.token_ids:
                    # The worker wrote these to the stream itself: bill what the stream
                    # verifiably holds (signed, in order), not the count the worker reports.
                    await _take_verified(p, redis, len(p.delivered) + len(msg.final.token_ids),
                                         worker.worker_id)
                u = msg.final.usage
                p.prefill_device_s += u.prefill_device_seconds
                p.decode_device_s += u.decode_device_seconds
                if first:
                    p.cached_prompt_tokens = min(u.cached_prompt_tokens, len(p.entry.prompt_token_ids))
                    # From enqueue, not from the worker's arrival: a wait in the queue or in
                    # the router must show in the client's usage and in the bill.
                    p.queue_s = queue_wait_s(p.entry, sent_unix_ns) + u.queue_seconds
                    p.prefill_s = u.prefill_seconds
                # Ended: a later sync must not count the last chunk's end marker again.
                p.end_reason = FinishReason.from_proto(msg.final.finish_reason)
                return p.end_reason
        log.warning("request %s: worker %s ended the stream without a final", p.entry.request_id,
                    worker.worker_id)
    except grpc.aio.AioRpcError as exc:
        # CANCELLED that the client did not ask for: the channel closed under the call (the
        # worker's lease lapsed and the registry dropped it) — another worker can take over.
        channel_closed = exc.code() == grpc.StatusCode.CANCELLED and not p.cancelled
        if exc.code() not in _RETRYABLE and not channel_closed:
            # The call can fail after the request ended (a deadline firing between the worker's
            # marked last chunk and its final message): then it completed.
            await sync_delivered(p, redis)
            if p.end_reason is not None:
                return p.end_reason
            # The caller writes the error event first and then syncs, so that a token the worker
            # appends meanwhile is either before the error event (and billed) or refused.
            raise RequestFailed(exc.code().name, exc.details() or exc.code().name) from exc
        log.warning("request %s: worker %s failed (%s); will retry", p.entry.request_id,
                    worker.worker_id, exc.code().name)
    except queue.IndexTaken:
        call.cancel()
        log.warning("request %s: its result stream moved past this attempt", p.entry.request_id)
    # Broke off retryably: the next attempt resumes from what the stream holds, unless that
    # shows the request ended (the worker wrote its last chunk, then its final was lost).
    await sync_delivered(p, redis)
    return p.end_reason


def _attributes(p: RequestProgress, finish_reason: str, device_type: str) -> dict:
    e = p.entry
    return billing.record_attributes(
        request_id=e.request_id, tenant_id=e.tenant_id, model=e.model,
        request_class=e.request_class, usage=p.usage(), finish_reason=finish_reason,
        device_type=device_type, worker_ids=p.worker_ids, operation=e.operation)


def billing_fields(p: RequestProgress, finish_reason: str, device_type: str,
                   span: trace.Span | None) -> dict[str, str]:
    """The request's billing record for llmmesh.billing's stream, in its dispatch span's trace."""
    e = p.entry
    attributes = _attributes(p, finish_reason, device_type)
    ctx = span.get_span_context() if span is not None else None
    now = time.time_ns()
    return billing.encode_record(
        attributes, start_unix_ns=e.enqueued_unix_ns or now, end_unix_ns=now,
        trace_id=f"{ctx.trace_id:032x}" if ctx and ctx.is_valid else "",
        parent_span_id=f"{ctx.span_id:016x}" if ctx and ctx.is_valid else "")


def record_usage(span: trace.Span, p: RequestProgress, finish_reason: str, device_type: str) -> None:
    """The request's usage on its dispatch span, for tracing; the bill itself is the record
    billing_fields makes (this span carries no llmmesh.usage.final, so costd never bills it)."""
    attributes = _attributes(p, finish_reason, device_type)
    del attributes[vocab.USAGE_FINAL]
    span.set_attributes(attributes)
