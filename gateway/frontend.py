"""The gateway's transport-free core: admit a validated request, enqueue it, relay its results."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from opentelemetry import trace
from redis.exceptions import RedisError

from gateway.losses import NOT_BACK, LossKeeper, when_back
from gateway.tenants import Tenant
from gateway.textstream import TextStream
from gateway.validation import ValidRequest
from llmmesh import queue, streamauth, telemetry, vocab
from llmmesh.drain import DrainView
from llmmesh.admission import ALREADY_USED, QUEUE_FULL, REFUSALS, Admission, Reservation
from llmmesh.admission import keys as admission_keys
from llmmesh.errors import (AlreadyExists, DeadlineExceeded, InvalidArgument, MeshError,
                            ResourceExhausted, Unavailable, error_from_code)
from llmmesh.prefix_hash import block_hashes, cache_salt
from llmmesh.vocab import RequestClass

log = logging.getLogger("gateway.frontend")

# How long one XREAD blocks; bounds how late a deadline or a dead Redis is noticed.
_POLL_BLOCK_MS = 500
# Concurrency slots of requests without a deadline expire after this, should nobody settle them.
_DEFAULT_LEASE_S = 900.0
# A request already queued rides out a Redis outage this long (its entry and tokens are in the
# append-only file; the router resumes it): the relay reads on from where it was once Redis is
# back. Longer, or past the deadline: UNAVAILABLE. New requests fail at once meanwhile.
_OUTAGE_GRACE_S = 5.0
_OUTAGE_RETRY_S = 0.1
# A cancel that could not be published (Redis down) is tried again this long.
_CANCEL_RETRY_S = 60.0


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    block_size: int = 16
    max_queue_len: int = 10_000  # per class; beyond it new requests are refused, not dropped
    server_address: str = ""     # host:port clients call (server.address / server.port on spans)
    max_streams_per_tenant: int = 256   # open calls per tenant on this gateway; 0: no cap
    max_streams: int = 2048             # open calls on this gateway, all tenants; 0: no cap
    # A call that got no token or end for this long ends (DEADLINE_EXCEEDED, the request
    # cancelled), with or without a client deadline: no stream waits for ever; 0: never.
    idle_stream_s: float = 900.0
    # Interactive requests are refused while the queue would make them wait longer than this
    # for a seat (llmmesh.drain: the routers' drain reports); 0: the entry bound alone.
    interactive_max_wait_s: float = 0.0

    def __post_init__(self):
        if self.block_size <= 0 or self.max_queue_len <= 0:
            raise ValueError("block_size and max_queue_len must be positive")
        if (self.max_streams_per_tenant < 0 or self.max_streams < 0 or self.idle_stream_s < 0
                or self.interactive_max_wait_s < 0):
            raise ValueError("max_streams_per_tenant, max_streams, idle_stream_s and "
                             "interactive_max_wait_s must be >= 0")


@dataclass(slots=True)
class TokensOut:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Admitted:
    """The request passed admission and is queued (only when generate(announce=True)): a
    front whose status line must say whether it was refused (HTTP) waits for this."""
    request_id: str      # the mesh's id (tenant/client id/nonce): the ledger's key
    request_class: str


@dataclass(slots=True)
class FinalOut:
    request_id: str
    request_class: str
    finish_reason: str
    usage: dict


class Frontend:
    def __init__(self, redis: aioredis.Redis, config: FrontendConfig, tracer, metrics=None):
        self.redis = redis
        self.config = config
        self.tracer = tracer
        self.admission = Admission(redis)
        self.metrics = metrics    # gateway.metrics.GatewayMetrics, or None
        self._open_streams: dict[str, int] = {}   # tenant id -> calls open on this gateway
        self._num_open = 0
        self._cancels: set[asyncio.Task] = set()   # cancels waiting for Redis to come back
        self.losses = LossKeeper(redis)            # bills, should Redis lose its data
        self.drain = DrainView(redis)              # read by its loop when a wait bound is set
        host, _, port = config.server_address.rpartition(":")
        self._server = ({vocab.SERVER_ADDRESS: host, vocab.SERVER_PORT: int(port)}
                        if port.isdigit() else {})

    async def generate(self, tenant: Tenant, req: ValidRequest, deadline_unix_ns: int, *,
                       announce: bool = False, span_attributes: dict | None = None,
                       ) -> AsyncIterator[Admitted | TokensOut | FinalOut]:
        """Admit, enqueue and relay one request. With `announce`, an Admitted event comes
        first, once the request is queued; `span_attributes` go on the gateway's span."""
        tenant.check_model(req.model.name, req.model.allowed_tenants)
        request_class = tenant.cap_class(req.requested_class)
        # One tenant's open calls are bounded on each gateway (idle streams hold memory and a
        # file descriptor each): beyond the cap, a clear refusal instead of a slow gateway.
        cap, tid = self.config.max_streams_per_tenant, tenant.tenant_id
        if cap and self._open_streams.get(tid, 0) >= cap:
            raise ResourceExhausted(
                f"tenant {tid} has {cap} calls open on this gateway, its limit "
                "(--max-streams-per-tenant): wait for one to end, or retry", retry_after_s=1.0)
        if self.config.max_streams and self._num_open >= self.config.max_streams:
            raise ResourceExhausted(
                f"this gateway has {self.config.max_streams} calls open, its limit "
                "(--max-streams): retry, or through another gateway", retry_after_s=1.0)
        self._open_streams[tid] = self._open_streams.get(tid, 0) + 1
        self._num_open += 1
        # aclosing: a consumer that stops early closes the inner generator (and its span) here,
        # in this task, not in a finalizer elsewhere.
        events = contextlib.aclosing(self._generate(tenant, req, request_class, deadline_unix_ns,
                                                    announce, span_attributes))
        start, first, last, num_output, error_type = time.perf_counter(), None, None, 0, ""
        try:
            async with events as inner:
                async for out in inner:
                    if isinstance(out, TokensOut) and out.token_ids:
                        last = time.perf_counter()
                        first = first or last
                        num_output += len(out.token_ids)
                    yield out
        except (Exception, asyncio.CancelledError) as exc:
            error_type = (exc.code.name if isinstance(exc, MeshError) else "CANCELLED"
                          if isinstance(exc, asyncio.CancelledError) else type(exc).__name__)
            raise
        finally:
            self._num_open -= 1
            self._open_streams[tid] -= 1
            if not self._open_streams[tid]:
                del self._open_streams[tid]
            if self.metrics is not None:
                self.metrics.request(operation=req.operation, model=req.model.name,
                                     tenant=tenant.tenant_id, request_class=request_class,
                                     start=start, first=first, last=last, num_output=num_output,
                                     num_input=len(req.prompt_token_ids), end=time.perf_counter(),
                                     error_type=error_type)

    def open_streams(self, tenant_id: str) -> int:
        return self._open_streams.get(tenant_id, 0)

    async def _generate(self, tenant: Tenant, req: ValidRequest, request_class: str,
                        deadline_unix_ns: int, announce: bool, span_attributes: dict | None
                        ) -> AsyncIterator[Admitted | TokensOut | FinalOut]:
        with self.tracer.start_as_current_span(telemetry.span_name(req.operation, req.model.name),
                                               kind=trace.SpanKind.SERVER) as span:
            entry = self.build_entry(tenant, req, request_class, deadline_unix_ns)
            span.set_attributes({
                vocab.OPERATION: req.operation, vocab.PROVIDER: vocab.PROVIDER_NAME,
                vocab.REQUEST_MODEL: req.model.name, **telemetry.request_attributes(req.sampling),
                vocab.RESPONSE_ID: entry.request_id,
                vocab.TENANT_ID: tenant.tenant_id, vocab.REQUEST_ID: entry.request_id,
                vocab.CLIENT_REQUEST_ID: req.request_id, vocab.REQUEST_CLASS: request_class,
                **self._server, **(span_attributes or {})})
            ended = False
            # Read before the enqueue: a wipe noticed from here on is checked by the relay (one
            # noticed between the enqueue and the relay's start used to go unseen).
            generation = self.losses.epoch.generation
            try:
                enqueue = asyncio.ensure_future(
                    self._admit_and_enqueue(tenant, req, entry, deadline_unix_ns))
                try:
                    await asyncio.shield(enqueue)
                except asyncio.CancelledError:
                    # The client went away mid-call. Abort the request only if the script did
                    # enqueue it: a refused one may share its id with another request (another
                    # tenant's, or this client's retry), which a cancel would abort.
                    with contextlib.suppress(Exception):
                        await asyncio.shield(enqueue)
                        await self._cancel(entry.request_id)
                    raise
                if announce:
                    yield Admitted(entry.request_id, request_class)
                claim = queue.claim_key(tenant.tenant_id, req.request_id)
                async for out in self._relay(req, entry, deadline_unix_ns, claim, generation):
                    if isinstance(out, FinalOut):
                        ended = True
                        span.set_attributes({
                            vocab.RESPONSE_MODEL: req.model.name,
                            vocab.FINISH_REASONS: [out.finish_reason],
                            vocab.INPUT_TOKENS: out.usage.get("prompt_tokens", 0),
                            vocab.OUTPUT_TOKENS: out.usage.get("completion_tokens", 0)})
                    yield out
            except RedisError as exc:
                span.set_attribute(vocab.ERROR_TYPE, "UNAVAILABLE")
                raise Unavailable(f"queue store unavailable ({type(exc).__name__}); retry") from exc
            except MeshError as exc:
                span.set_attribute(vocab.ERROR_TYPE, exc.code.name)
                raise
            except asyncio.CancelledError:
                span.set_attribute(vocab.ERROR_TYPE, "CANCELLED")
                raise
            except GeneratorExit:
                # Closed by its consumer: the client went away (a deadline, a cancel) while a
                # token was on its way to it, so no CancelledError reached this frame.
                if not ended:
                    span.set_attribute(vocab.ERROR_TYPE, "CANCELLED")
                raise

    async def _admit_and_enqueue(self, tenant: Tenant, req: ValidRequest, entry: queue.QueueEntry,
                                 deadline_unix_ns: int) -> None:
        """Admission, the request id's claim, the queue bound and the enqueue: all or nothing,
        in one round trip (llmmesh.admission's enqueue script), the only one before a router
        can read the request.

        The claim is per (tenant, client request id); the entry's own id is unique per
        admission (queue.mesh_request_id), so no two requests ever share a stream or a bill.
        """
        if deadline_unix_ns and time.time_ns() >= deadline_unix_ns:
            raise DeadlineExceeded("deadline passed before the request was queued")
        plan = tenant.plan
        need = len(req.prompt_token_ids) + req.sampling["max_tokens"]
        for limit, what in ((plan.tokens_per_minute, "tokens-per-minute limit"),
                            (plan.token_budget, "token budget")):
            if limit and need > limit:
                raise InvalidArgument("sampling.max_tokens", f"prompt + max_tokens = {need} tokens "
                                      f"exceeds your plan's {what} of {limit}; lower max_tokens")
        period, period_end_s = plan.period(time.time())
        lease_s = (deadline_unix_ns - time.time_ns()) / 1e9 if deadline_unix_ns else _DEFAULT_LEASE_S
        # Each admission holds its own reservation: a client re-sending a request id that is
        # still running gets ALREADY_EXISTS and must never touch the running request's
        # concurrency slot or settle marker.
        reservation_id = f"{entry.request_id}#{secrets.token_hex(4)}"
        budget_key = admission_keys(tenant.tenant_id, period)[3] if plan.token_budget else ""
        # The entry carries its reservation, so whoever ends the request settles it.
        entry.reservation = Reservation(tenant.tenant_id, reservation_id, need, budget_key).to_dict()
        max_len, wait_bound = self._queue_bound(entry.request_class)
        code, retry_s = await self.admission.admit_and_enqueue(
            claim_key=queue.claim_key(tenant.tenant_id, req.request_id), claim_value=entry.request_id,
            claim_ttl_s=queue.RESULT_TTL_S, stream=queue.queue_stream(entry.request_class),
            max_len=max_len, fields=entry.encode(),
            tenant_id=tenant.tenant_id, request_id=reservation_id,
            rpm=plan.requests_per_minute, tpm=plan.tokens_per_minute,
            max_concurrent=plan.max_concurrent, budget=plan.token_budget, period=period,
            period_end_s=period_end_s, tokens=need, lease_s=max(1.0, lease_s))
        if self.metrics is not None:
            self.metrics.admission(tenant.tenant_id, entry.request_class, code)
        if code == ALREADY_USED:
            raise AlreadyExists(f"request_id {req.request_id!r} was already used")
        if code == QUEUE_FULL and wait_bound:
            wait_ms = self.config.interactive_max_wait_s * 1000
            raise ResourceExhausted(
                f"{entry.request_class} queue would make this request wait over {wait_ms:.0f} ms "
                "for a seat (the gateway's --interactive-max-wait-ms); retry shortly, or send it "
                "as batch work", retry_after_s=max(0.05, self.config.interactive_max_wait_s))
        if code == QUEUE_FULL:
            raise ResourceExhausted(f"{entry.request_class} queue is full", retry_after_s=retry_s)
        if code:
            raise ResourceExhausted(f"tenant {tenant.tenant_id}: {REFUSALS[code]} reached", retry_s)

    def _queue_bound(self, request_class: str) -> tuple[int, bool]:
        """(entries the class's stream may hold for a new one to be admitted, whether the wait
        bound is what sets it)."""
        max_len, max_wait_s = self.config.max_queue_len, self.config.interactive_max_wait_s
        if not max_wait_s or request_class != RequestClass.INTERACTIVE:
            return max_len, False
        drain = self.drain.current(request_class)
        if drain is None:   # no fresh router report: nothing to estimate the wait from
            return max_len, False
        bound = max(1, drain.bound(max_wait_s))
        return min(max_len, bound), bound < max_len

    def build_entry(self, tenant: Tenant, req: ValidRequest, request_class: str,
               deadline_unix_ns: int) -> queue.QueueEntry:
        # The salt comes from the tenant's configured scope, never from the client.
        salt = cache_salt(tenant.cache_scope, req.model.name)
        return queue.QueueEntry(
            request_id=queue.mesh_request_id(tenant.tenant_id, req.request_id),
            tenant_id=tenant.tenant_id, request_class=request_class,
            model=req.model.name, prompt_token_ids=req.prompt_token_ids, sampling=req.sampling,
            cache_salt=salt,
            block_hashes=block_hashes(req.prompt_token_ids, self.config.block_size, salt),
            deadline_unix_ns=deadline_unix_ns, enqueued_unix_ns=time.time_ns(),
            traceparent=telemetry.inject_traceparent(), operation=req.operation,
            stream_key=streamauth.new_stream_key())

    async def _relay(self, req: ValidRequest, entry: queue.QueueEntry, deadline_unix_ns: int,
                     claim: str, generation: int) -> AsyncIterator[TokensOut | FinalOut]:
        request_id, request_class = entry.request_id, entry.request_class
        detok = TextStream(req.model.tokenizer, req.sampling.get("stop"))
        # Only what the request's current attempt and its router signed reaches the client.
        check = streamauth.StreamCheck(entry.stream_key, request_id)
        stream, last_id, finished, next_index = queue.result_stream(request_id), "0-0", False, 0
        task = asyncio.current_task()
        # A wipe seen by the epoch watcher (`generation` moved) but not by this call (its
        # connection survived, or redis-py retried on a new one) is checked like an outage.
        outage_since = None
        idle_s = self.config.idle_stream_s
        last_event = time.monotonic()
        try:
            while True:
                if deadline_unix_ns and time.time_ns() > deadline_unix_ns:
                    raise DeadlineExceeded("deadline passed before the request finished")
                if idle_s and time.monotonic() - last_event > idle_s:
                    raise DeadlineExceeded(
                        f"no token for {idle_s:g} s (the gateway's --idle-stream-s); the request "
                        "was cancelled: retry, or with batch work use a batch job")
                try:
                    reply = await self.redis.xread({stream: last_id}, count=64, block=_POLL_BLOCK_MS)
                    if outage_since is not None or generation != self.losses.epoch.generation:
                        if not await self._survived(request_id, claim, outage_since):
                            await self.losses.bill_lost(entry, next_index)
                            raise Unavailable("the queue store lost this request (it restarted "
                                              "without its data); retry")
                        outage_since, generation = None, self.losses.epoch.generation
                except RedisError:
                    outage_since = outage_since or time.monotonic()
                    if time.monotonic() - outage_since > _OUTAGE_GRACE_S:
                        # Whether Redis comes back with the request or without it is not known
                        # yet: if without, its gateway is still the one to bill what it relayed.
                        self.losses.check_lost_later(entry, claim, next_index)
                        raise
                    await asyncio.sleep(_OUTAGE_RETRY_S)
                    continue
                if task is not None and task.cancelling():
                    # The client went away but the cancel was swallowed on the way: Python
                    # 3.11's asyncio.wait_for (redis-py wraps each send in it) returns its
                    # result instead of raising when the cancel lands as the send completes
                    # (CPython gh-86296). The request must still end here.
                    raise asyncio.CancelledError("client cancelled (re-raised after a lost cancel)")
                for _, entries in reply or ():
                    for entry_id, fields in entries:
                        last_id = entry_id
                        event = check.accept(fields)
                        if event is None:
                            if self.metrics is not None:
                                self.metrics.stream_event_refused()
                            continue
                        last_event = time.monotonic()
                        if event["kind"] == "tokens":
                            if not event["ids"]:
                                continue   # a worker's empty last chunk (an end marker only)
                            next_index = event["index"] + len(event["ids"])
                            yield TokensOut(event["index"], event["ids"], detok.push(event["ids"]),
                                            event.get("logprobs", []))
                        elif event["kind"] == "final":
                            finished = True
                            # Kept before any yield: a slow client must not delay it past a
                            # replay that should have included it.
                            self.losses.finished(request_id, event.get("bill"))
                            tail = detok.flush()
                            if tail:
                                yield TokensOut(next_index, [], tail)
                            yield FinalOut(req.request_id, request_class,
                                           event["finish_reason"], event["usage"])
                            return
                        else:
                            finished = True
                            raise error_from_code(event["code"], event["message"])
        finally:
            if not finished:
                await self._cancel(request_id)

    async def _survived(self, request_id: str, claim: str, outage_since: float | None) -> bool:
        """After an outage: Redis restarted without its data if the request's id claim (written
        with its queue entry) is gone. Then nobody will ever run or end it."""
        if await self.redis.get(claim) == request_id:
            if outage_since is not None:
                log.info("request %s: Redis back after %.1f s; relaying on", request_id,
                         time.monotonic() - outage_since)
            return True
        log.error("request %s: lost with Redis's data (it restarted empty); client told "
                  "UNAVAILABLE", request_id)
        return False

    async def _cancel(self, request_id: str) -> None:
        # Runs while the client call is being torn down: never let it raise.
        try:
            await asyncio.shield(self._publish_cancel(request_id))
        except asyncio.CancelledError:
            pass
        except RedisError:
            # Redis is down: the request may still be in its append-only file and resume once
            # it is back. Cancel it then, so it neither runs on nor bills what nobody received.
            task = asyncio.get_running_loop().create_task(self._cancel_when_back(request_id))
            self._cancels.add(task)
            task.add_done_callback(self._cancels.discard)

    async def _cancel_when_back(self, request_id: str) -> None:
        if await when_back(lambda: self._publish_cancel(request_id), _CANCEL_RETRY_S) is NOT_BACK:
            log.warning("request %s: cancel not published within %.0f s", request_id,
                        _CANCEL_RETRY_S)

    async def _publish_cancel(self, request_id: str) -> None:
        await self.redis.set(queue.cancel_key(request_id), "1", ex=queue.RESULT_TTL_S)
        await self.redis.publish(queue.CANCEL_CHANNEL, request_id)
