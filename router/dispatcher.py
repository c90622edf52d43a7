"""Reads both class queues as one consumer group and runs each request on a worker.

Interactive entries are read first; `batch_min_share` guarantees batch a floor of the
dispatches so a steady interactive stream can never starve it. An entry is acknowledged
only after its request has ended (completion or typed error written to its result stream).
"""
from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from opentelemetry import trace
from redis.exceptions import RedisError, ResponseError

from llmmesh import billing, queue, streamauth, telemetry, vocab
from llmmesh.aio import wait_event
from llmmesh.admission import Admission, Reservation
from llmmesh.drain import HEARTBEAT_S, MIN_PUBLISH_S, DrainMeter, WorkerSeats
from llmmesh.epoch import RedisEpoch
from llmmesh.jobs import JobResults
from llmmesh.v1 import worker_pb2
from llmmesh.vocab import CLASSES, FinishReason, RequestClass
from router import faults
from router.ending import Ended, EndScripts
from router.fairness import ClassPolicy, ClassScheduler
from router.policy import Policy, place
from router.registry import WorkerHandle, WorkerRegistry
from router.relay import (MAX_ATTEMPTS, RequestFailed, RequestProgress, apply_stream_state,
                          billing_fields, read_result_stream, record_usage, run_attempt,
                          sync_delivered)

log = logging.getLogger("router.dispatcher")
HELD_RECHECK_MS = 20
# A request whose Redis failed under it is tried again this often (Redis restarting).
REDIS_RETRY_S = 0.25


@dataclass(frozen=True, slots=True)
class DispatcherConfig:
    consumer: str
    class_policy: ClassPolicy = ClassPolicy()
    quantum_tokens: int = 512
    # Entries read ahead of dispatch: fair sharing can only choose among what it has read.
    prefetch: int = 256
    block_ms: int = 200
    # Entries pending this long on a router that stopped heartbeating are taken over.
    claim_idle_ms: int = 15_000
    heartbeat_s: float = 3.0

    def __post_init__(self):
        if self.prefetch <= 0 or self.claim_idle_ms <= self.heartbeat_s * 2000:
            raise ValueError("prefetch must be positive and claim_idle_ms > 2 heartbeats")


@dataclass(slots=True)
class Held:
    """A queue entry this router has read and not yet acknowledged."""

    request_class: str
    entry_id: str
    progress: RequestProgress
    # Read fresh from the queue (">"): never delivered to any router, so its result stream is
    # empty and reading it back can be skipped. False for entries taken over from a router.
    fresh: bool = False
    # Let go before it started (Redis lost it with its data, or another router took it over):
    # never run here (Dispatcher._drop).
    dropped: bool = False


def _error_for_undecodable(fields: dict) -> tuple[str, dict[str, str]] | None:
    """(result stream, error event) for the request an undecodable entry names, if it names
    one: signed with the router's key when its stream key reads (else its gateway drops it)."""
    try:
        body = json.loads(fields.get("d") or fields.get(b"d") or "")
        rid, stream_key = body.get("request_id"), body.get("stream_key")
        key = streamauth.router_key(stream_key) if isinstance(stream_key, str) and stream_key else None
    except (ValueError, TypeError, AttributeError):
        return None
    if not isinstance(rid, str) or not 0 < len(rid) <= 512:
        return None
    return queue.result_stream(rid), queue.error_event(
        "INTERNAL", "this request's queue entry could not be read; retry", key)


class Dispatcher:
    def __init__(self, redis: aioredis.Redis, registry: WorkerRegistry, policy: Policy,
                 config: DispatcherConfig, tracer: trace.Tracer):
        self.redis, self.registry, self.policy = redis, registry, policy
        self.config, self.tracer = config, tracer
        self.admission = Admission(redis)
        self.jobs = JobResults(redis)
        self.sched: ClassScheduler[Held] = ClassScheduler(config.class_policy, config.quantum_tokens)
        # (class, entry id) -> entry, buffered or running. The class is part of the key because
        # the two queues are separate streams whose ids are each "<ms>-<seq>": an interactive and
        # a batch entry added in the same millisecond share an id, and keying by id alone left
        # the second one unread until another router's takeover, 15 s later.
        self.held: dict[tuple[str, str], Held] = {}
        self.running: dict[str, Held] = {}       # request id -> entry being served
        self._slot_freed = asyncio.Event()
        self._batch_inflight = 0
        self._side_tasks: set[asyncio.Task] = set()
        self.metrics = None   # router.metrics.RouterMetrics, or None
        self.epoch = RedisEpoch(redis)
        # The bills this router wrote lately, to write again if Redis loses them unshipped
        # (llmmesh.billing.RecentBills): batch-job items, errors and cancels pass no final
        # through a gateway, which keeps only what finals carry.
        self.bills = billing.RecentBills()
        self.ends = EndScripts(redis)
        self.drain = DrainMeter(config.consumer)
        # (deadline, class, entry id) of each held entry that has one: one that passes while
        # the entry still waits for a slot here ends it at once (_expire_waiting).
        self._deadlines: list[tuple[int, str, str]] = []

    async def ensure_groups(self) -> None:
        for cls in CLASSES:
            with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists already
                await self.redis.xgroup_create(queue.queue_stream(cls), queue.ROUTER_GROUP,
                                               id="0", mkstream=True)

    async def run(self) -> None:
        await self.ensure_groups()
        while True:
            try:
                await self._fill()
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("consumer group missing (Redis restarted?); recreating it")
                await self.ensure_groups()
                continue
            except RedisError as exc:
                log.warning("queue read failed (%s); retrying", exc)
                await asyncio.sleep(0.5)
                continue
            self._dispatch_ready()

    def _slots(self) -> tuple[int, int, int]:
        """(free slots, all slots, where an interactive request can start: free slots and seats
        it may take from batch past the slot cap)."""
        workers = [h for h in self.registry.workers.values() if h.healthy]
        share = self.config.class_policy.batch_min_share
        return (sum(h.free_slots for h in workers), sum(h.max_inflight for h in workers),
                sum(h.interactive_room(share) for h in workers))

    async def _fill(self) -> None:
        self._expire_waiting()
        room = self.config.prefetch - len(self.sched)
        free, total, interactive_free = self._slots()
        if room <= 0 or (len(self.sched) and free <= 0 and interactive_free <= 0):
            # Nothing can be read or nothing held can go: wait for a request to end, or for
            # the next deadline of an entry that waits here.
            self._slot_freed.clear()
            wait_s = 0.05
            if self._deadlines:
                wait_s = min(wait_s, max(0.0, (self._deadlines[0][0] - time.time_ns()) / 1e9))
            await wait_event(self._slot_freed, wait_s)
            self._expire_waiting()
            if room <= 0:
                return
            block = None
        elif self.sched.ready(free, total, self._batch_inflight, interactive_free):
            block = None        # something goes now: only pick up what already arrived
        elif len(self.sched):
            # Held batch work waits for batch's share of the slots: a new interactive entry
            # must still wake us at once, and a batch request ending is noticed within this.
            block = min(self.config.block_ms, HELD_RECHECK_MS)
        else:
            block = self.config.block_ms
        streams = {queue.queue_stream(c): ">" for c in CLASSES}
        reply = await self.redis.xreadgroup(queue.ROUTER_GROUP, self.config.consumer, streams,
                                            count=room, block=block)
        for stream, entries in reply or ():
            cls = stream.rsplit(":", 1)[1]
            for entry_id, fields in entries:
                self._hold(cls, entry_id, fields, fresh=True)

    def _hold(self, cls: str, entry_id: str, fields: dict, fresh: bool = False) -> None:
        if (cls, entry_id) in self.held:
            return
        try:
            entry = queue.QueueEntry.decode(fields)
            # Fields of the wrong type decode (JSON has no schema) and fail here instead: this
            # runs in the claim loop too, where it used to stop every entry claimed after it.
            cost = len(entry.prompt_token_ids) + int(entry.sampling.get("max_tokens", 0))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            # A rolling upgrade's new field, or a stranger's write: never fatal to the loop.
            log.error("undecodable %s entry %s (%s): dead-lettered", cls, entry_id, exc)
            self._spawn(self._drop_undecodable(cls, entry_id, fields,
                                               f"undecodable: {type(exc).__name__}: {exc}"))
            return
        held = Held(cls, entry_id, RequestProgress(entry), fresh)
        self.held[cls, entry_id] = held
        self.sched.push(cls, entry.tenant_id, held, cost)
        if entry.deadline_unix_ns:
            if len(self._deadlines) > 2 * len(self.held) + 64:
                # Those of entries that ended first stay until their time: drop them now and
                # then, so long deadlines at a high rate cannot grow the heap without bound.
                self._deadlines = [d for d in self._deadlines if (d[1], d[2]) in self.held]
                heapq.heapify(self._deadlines)
            heapq.heappush(self._deadlines, (entry.deadline_unix_ns, cls, entry_id))

    def _expire_waiting(self) -> None:
        """Ends each entry whose deadline passed while it waited here for a slot: DEADLINE_EXCEEDED
        at its deadline, not when a slot frees (F2: behind a slow worker's full slots, that was
        120 ms and more late; with no worker at all, never until one came). It goes through
        _start, whose _attempts ends it before any worker is picked."""
        now = time.time_ns()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, cls, entry_id = heapq.heappop(self._deadlines)
            held = self.held.get((cls, entry_id))
            if held is None or held.dropped or held.progress.entry.request_id in self.running:
                continue   # ended, let go or running: its attempt watches the deadline
            if self.sched.remove(cls, held.progress.entry.tenant_id, held):
                self._start(held)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _drop_undecodable(self, cls: str, entry_id: str, fields: dict, reason: str) -> None:
        stream = queue.queue_stream(cls)
        try:
            await queue.dead_letter(self.redis, queue.dead_letter_record(
                entry_id=entry_id, request_class=cls, reason=reason,
                deliveries=await self._deliveries(stream, entry_id)))
            told = _error_for_undecodable(fields)
            if told is not None:   # its gateway waits on it: a typed error, not its deadline
                await self.redis.xadd(*told)
                await self.redis.expire(told[0], queue.RESULT_TTL_S)
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xack(queue.queue_stream(cls), queue.ROUTER_GROUP, entry_id)
                pipe.xdel(queue.queue_stream(cls), entry_id)
                await pipe.execute()
        except RedisError as exc:   # left pending: the next takeover tries again
            log.warning("could not dead-letter %s entry %s: %s", cls, entry_id, exc)

    def _dispatch_ready(self) -> None:
        while True:
            free, total, interactive_free = self._slots()
            picked = self.sched.pop(free, total, self._batch_inflight, interactive_free)
            if picked is None:
                return
            self._start(picked[1])

    def _start(self, held: Held) -> None:
        rid = held.progress.entry.request_id
        if held.dropped:   # let go while it waited here (_drop)
            return
        self.running[rid] = held
        if held.request_class == RequestClass.BATCH:
            self._batch_inflight += 1
        task = asyncio.create_task(self._serve_through_outages(held))

        def done(_):
            self.drain.ended(held.request_class)
            self.running.pop(rid, None)
            if self.held.get((held.request_class, held.entry_id)) is held:
                del self.held[held.request_class, held.entry_id]
            if held.request_class == RequestClass.BATCH:
                self._batch_inflight -= 1
            self._slot_freed.set()
        task.add_done_callback(done)

    async def _serve_through_outages(self, held: Held) -> None:
        """_serve, again after Redis failed under it (it kept the request's entry and tokens in
        its append-only file): from what the result stream holds once Redis answers, while
        this router still holds the entry, so no other router takes it over meanwhile."""
        fresh = held.fresh
        while True:
            try:
                await self._serve(held.request_class, held.entry_id, held.progress, fresh)
                return
            except RedisError as exc:
                log.warning("request %s: Redis failed under it (%s); resuming it once Redis "
                            "answers", held.progress.entry.request_id, exc)
            except Exception:  # noqa: BLE001 - a poison entry must not die unseen
                # Left pending: a router takes it over after claim_idle_ms and Redis counts
                # that delivery, so an entry that fails every time is dead-lettered after
                # queue.MAX_DELIVERIES, whichever routers held it (and whatever they remember).
                log.exception("request %s (%s entry %s, delivery %d): dispatch failed; left "
                              "for redelivery", held.progress.entry.request_id,
                              held.request_class, held.entry_id, held.progress.delivery)
                return
            fresh = False
            await asyncio.sleep(REDIS_RETRY_S)
            if not await self._still_queued(held):
                return

    async def _still_queued(self, held: Held) -> bool:
        """Whether Redis still holds the entry after an outage (False: it restarted without its
        data; the request's gateway tells its client UNAVAILABLE, and nothing is run or billed)."""
        try:
            if await self._deliveries(queue.queue_stream(held.request_class), held.entry_id):
                return True
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                return True
        except RedisError:
            return True   # still down: _serve finds out and waits again
        log.error("request %s: its queue entry is gone (Redis restarted without its data); "
                  "dropped", held.progress.entry.request_id)
        return False

    async def _serve(self, cls: str, entry_id: str, p: RequestProgress, fresh: bool = False) -> None:
        e = p.entry
        early_check = None
        if fresh and cls == RequestClass.INTERACTIVE:
            # Nothing to recover, and the client-went-away check need not hold up the first
            # token: it runs beside the worker call (one Redis round trip off the TTFT path).
            # Batch keeps checking first: a cancelled job's queued requests must not start.
            ended, cancelled = None, False
            early_check = asyncio.create_task(self._check_cancelled_early(p))
        else:
            ended, cancelled = await self._recover_progress(p)
        if ended is not None:  # a router died between ending the request and acknowledging it
            if ended["kind"] == "final":
                outcome = {"finish_reason": ended["finish_reason"], "usage": ended["usage"]}
            else:
                outcome = {"error_code": ended["code"], "error_message": ended["message"]}
                if p.delivered:
                    # Its bill went in after the error event: the dead router may not have
                    # written it. Written again here; the ledger keeps the first of the two.
                    await self.redis.xadd(billing.BILLING_STREAM, billing_fields(p, "error", "", None))
            await self._finish(cls, entry_id, p, ended["kind"] == "final" or bool(p.delivered), outcome)
            return
        ctx = telemetry.extract_context(e.traceparent)
        billed = False
        with self.tracer.start_as_current_span("router dispatch", context=ctx) as span:
            try:
                reason, device = await self._attempts(p, cancelled, entry_id)
                if early_check is not None and await early_check and not p.delivered:
                    # Cancelled before the router took it: ends as before, unbilled.
                    raise RequestFailed("CANCELLED", "request cancelled before it started")
                # The final and its bill in one atomic step, only while this router holds the
                # entry: a request that ended has a durable bill, whatever instant this router
                # dies at (llmmesh.billing), and one that Redis lost or another router took
                # over is neither ended nor billed here (router.ending).
                bill = billing_fields(p, reason, device, span)
                if not await self._end(cls, entry_id, p, bill=bill, event=queue.final_event(
                        reason, p.usage(), p.router_key(), bill=bill["d"])):
                    return
                faults.reached("billed")
                record_usage(span, p, reason, device)
                billed = True
                outcome = {"finish_reason": reason, "usage": p.usage()}
            except RequestFailed as exc:
                span.set_status(trace.StatusCode.ERROR, exc.message)
                span.set_attribute(vocab.ERROR_TYPE, exc.code)
                if not await self._end(cls, entry_id, p, event=queue.error_event(
                        exc.code, exc.message, p.router_key())):
                    return
                # Workers append to the stream themselves: after the error event nothing more
                # can be, so what it holds now is exactly what the client got.
                await sync_delivered(p, self.redis)
                if p.delivered:  # tokens were produced and delivered: they are billed
                    # Refused only if the entry left us since the error event: its new owner
                    # finds the error and writes the bill (the ended-request path above).
                    if not await self._end(cls, entry_id, p,
                                           bill=billing_fields(p, "error", "", span)):
                        return
                    record_usage(span, p, "error", "")
                    billed = True
                outcome = {"error_code": exc.code, "error_message": exc.message}
            finally:
                if early_check is not None and not early_check.done():
                    early_check.cancel()   # the request ended first (it aborts nothing now)
            await self._finish(cls, entry_id, p, billed, outcome)

    async def _end(self, cls: str, entry_id: str, p: RequestProgress, *,
                   event: dict[str, str] | None = None, bill: dict[str, str] | None = None) -> bool:
        """Writes the request's end event and/or bill while this router holds its entry
        (router.ending) and keeps the bill for a replay; False: let go, nothing more to do."""
        wrote = await self.ends.write_end(request_class=cls, entry_id=entry_id,
                                          consumer=self.config.consumer,
                                          request_id=p.entry.request_id, event=event, bill=bill)
        if wrote is not Ended.WRITTEN:
            await self._let_go(p, wrote)
            return False
        if bill is not None:
            self.bills.remember(p.entry.request_id, bill)
        return True

    async def _let_go(self, p: RequestProgress, why: Ended) -> None:
        """The request is no longer this router's to end (router.ending): nothing is written,
        settled or acknowledged here."""
        rid = p.entry.request_id
        if why is Ended.TAKEN_OVER:
            log.warning("request %s: another router took its entry over while it ran here (this "
                        "one stalled past --claim-idle-ms); left to it", rid)
            return
        log.error("request %s: its queue entry is gone (Redis lost its data, or another router "
                  "ended it); not ended or billed here: after a loss its gateway told the client "
                  "UNAVAILABLE and bills the tokens it relayed (%d in this router's view)", rid,
                  len(p.delivered))
        # What its worker appended into the new Redis: no router will expire it otherwise.
        with contextlib.suppress(RedisError):
            await self.redis.expire(queue.result_stream(rid), queue.RESULT_TTL_S)

    async def publish_drain(self) -> None:
        """Loop: what runs per class, how fast it ends and the workers' seats, for the gateways'
        wait bound (llmmesh.drain)."""
        while True:
            running = {c: 0 for c in CLASSES}
            for held in list(self.running.values()):
                running[held.request_class] += 1
            share = self.config.class_policy.batch_min_share
            workers = {h.worker_id: WorkerSeats(h.max_running or h.max_inflight, h.max_inflight,
                                                h.num_inflight, h.num_interactive,
                                                h.interactive_seats(share))
                       for h in self.registry.workers.values() if h.serving}
            self.drain.changed.clear()
            try:
                await self.drain.publish(self.redis, running, workers)
            except RedisError as exc:
                log.debug("drain report not published: %s", exc)
                await asyncio.sleep(HEARTBEAT_S)
            # Changes during the publish (and the pause) are coalesced into the next one.
            await asyncio.sleep(MIN_PUBLISH_S)
            await wait_event(self.drain.changed, HEARTBEAT_S)

    async def watch_epoch(self) -> None:
        """Notices Redis coming back without its data (llmmesh.epoch) and lets go of what it took."""
        await self.epoch.watch(self._after_data_loss)

    async def _after_data_loss(self) -> None:
        """Entries read from the lost Redis are dropped before they run (running ones are
        aborted: their end is refused anyway), and this router's recent bills written again."""
        # Judged: what was held before asking (an entry read from the new Redis meanwhile is
        # pending, but XPENDING was asked before it existed).
        before = list(self.held.items())
        mine: set[tuple[str, str]] = set()
        for cls in CLASSES:
            try:
                pending = await self.redis.xpending_range(
                    queue.queue_stream(cls), queue.ROUTER_GROUP, min="-", max="+",
                    count=max(1, len(self.held)), consumername=self.config.consumer)
            except ResponseError:   # NOGROUP: none of them survived
                pending = []
            mine.update((cls, p["message_id"]) for p in pending)
        lost = [h for key, h in before if key not in mine]
        for held in lost:
            if self._drop(held):   # running: its end is refused anyway; stop its worker now
                self._spawn(self._abort_on_worker(held.progress))
        log.error("dropped %d requests read before Redis lost its data (%d were running); "
                  "their gateways told the clients UNAVAILABLE", len(lost),
                  sum(h.progress.entry.request_id in self.running for h in lost))
        await self.ensure_groups()
        await self.bills.replay(self.redis)

    async def _finish(self, cls: str, entry_id: str, p: RequestProgress, billed: bool,
                      outcome: dict) -> None:
        """Everything after the outcome is written: job result, budget, acknowledgement."""
        e = p.entry
        if self.metrics is not None:
            self.metrics.ended(e.request_class, outcome.get("error_code", ""))
        await self.redis.expire(queue.result_stream(e.request_id), queue.RESULT_TTL_S)
        if e.job_id:
            if outcome.get("finish_reason") == FinishReason.CANCELLED:
                # Cancelled while it ran: a failed item of its job (BatchJob.num_failed counts
                # cancelled ones), not a completion; its tokens stay in the result and in the
                # job's totals, since they are billed.
                outcome = {**outcome, "error_code": "CANCELLED",
                           "error_message": f"cancelled after {len(p.delivered)} tokens"}
            await self.jobs.record(e.job_id, e.job_index, e.request_id, model=e.model,
                                   token_ids=p.delivered, **outcome)
        if e.reservation:
            used = len(e.prompt_token_ids) + len(p.delivered) if billed else 0
            await self.admission.settle(Reservation(**e.reservation), used, e.request_id)
        # Acknowledged and deleted: the stream's length is what waits or runs, which is what
        # the gateway's queue bound counts (acknowledged entries used to stay and fill it).
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(queue.queue_stream(cls), queue.ROUTER_GROUP, entry_id)
            pipe.xdel(queue.queue_stream(cls), entry_id)
            await pipe.execute()

    async def _attempts(self, p: RequestProgress, cancelled_early: bool,
                        entry_id: str = "") -> tuple[str, str]:
        e = p.entry
        if p.end_reason is not None:   # it ended on a worker; only the final is missing
            return p.end_reason, ""
        if e.deadline_unix_ns and time.time_ns() >= e.deadline_unix_ns:
            raise RequestFailed("DEADLINE_EXCEEDED", "deadline passed while the request was queued")
        if cancelled_early:
            raise RequestFailed("CANCELLED", "request cancelled before it started")
        if p.give_up is not None:
            await queue.dead_letter(self.redis, queue.dead_letter_record(
                entry_id=entry_id, request_class=e.request_class, entry=e, reason=p.give_up,
                deliveries=p.delivery))
            raise RequestFailed("UNAVAILABLE", f"{p.give_up}; retry later")
        while p.attempts < MAX_ATTEMPTS:
            if p.cancelled:
                raise RequestFailed("CANCELLED", "request cancelled by the client")
            # A request that broke off mid-stream goes to a serving worker at once, past the
            # slot cap: its client waits between two tokens (the engine seats it ahead too).
            worker = await self._pick(e, resuming=bool(p.delivered))
            if p.cancelled:   # the client went away while the request waited for a worker
                raise RequestFailed("CANCELLED", "request cancelled by the client")
            if self.metrics is not None and p.attempts == 0:
                self.metrics.dispatched(e.request_class, e.enqueued_unix_ns)
            p.worker_ids.append(worker.worker_id)
            probe = worker.breaker.on_dispatch() if worker.breaker else False
            worker.num_inflight += 1
            interactive = e.request_class == RequestClass.INTERACTIVE
            worker.num_interactive += interactive
            self.drain.changed.set()
            try:
                reason = await run_attempt(p, worker, self.redis)
            except BaseException:
                # A half-open probe that ends in a typed error (or is cancelled) gives its slot
                # back: it used to keep it, and the circuit stayed half-open for good.
                if probe:
                    worker.breaker.on_released()
                raise
            finally:
                worker.num_inflight -= 1
                worker.num_interactive -= interactive
                self._slot_freed.set()
                self.drain.changed.set()
            p.attempts += 1
            if reason is not None:
                if worker.breaker:
                    worker.breaker.on_success()
                device = worker.load.device_type if worker.load else ""
                return reason, device
            # Out of this request's way at once (a dead worker's lease and probe end it for
            # good); the breaker keeps count across lease refreshes, which clear this flag.
            worker.healthy = False
            if worker.breaker:
                worker.breaker.on_failure()
        await queue.dead_letter(self.redis, queue.dead_letter_record(
            entry_id=entry_id, request_class=e.request_class, entry=e, deliveries=p.delivery,
            reason=f"failed on {MAX_ATTEMPTS} workers"))
        raise RequestFailed("UNAVAILABLE", f"request failed on {MAX_ATTEMPTS} workers; retry later")

    async def _check_cancelled_early(self, p: RequestProgress) -> bool:
        """Whether the client cancelled before this router read the entry (its pubsub message
        came before the request was running here); if so, abort it on its worker."""
        # Let the first attempt's gRPC call (its send runs in a task created after this one)
        # go out before this Redis round trip.
        await asyncio.sleep(0)
        try:
            cancelled = bool(await self.redis.exists(queue.cancel_key(p.entry.request_id)))
        except RedisError as exc:
            log.warning("request %s: cancel check failed (%s)", p.entry.request_id, exc)
            return False
        if cancelled:
            await self._abort_on_worker(p)
        return cancelled

    async def _recover_progress(self, p: RequestProgress) -> tuple[dict | None, bool]:
        """For an entry taken over from a dead router: continue after the tokens its result
        stream already holds. Returns (the final or error event when the request had in fact
        ended, whether the client cancelled before it started) from one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xrange(queue.result_stream(p.entry.request_id))
            pipe.exists(queue.cancel_key(p.entry.request_id))
            events, cancelled = await pipe.execute()
        delivered, ended, end = read_result_stream(events, p.entry)
        if ended is not None:
            p.delivered = delivered
            return ended, bool(cancelled)
        apply_stream_state(p, delivered, end)
        if p.end_reason is not None:
            log.info("request %s had ended on its worker (%s) after %d tokens; finishing it",
                     p.entry.request_id, p.end_reason, len(p.delivered))
        elif p.delivered:
            log.info("request %s resumes after %d delivered tokens", p.entry.request_id,
                     len(p.delivered))
        return None, bool(cancelled)

    async def reclaim(self) -> None:
        """Heartbeat our own pending entries and take over those of routers that stopped."""
        while True:
            try:
                await self._heartbeat_and_claim()
            except RedisError as exc:
                log.warning("reclaim failed: %s", exc)
            await asyncio.sleep(self.config.heartbeat_s)

    async def _heartbeat_and_claim(self) -> None:
        for cls in CLASSES:
            stream = queue.queue_stream(cls)
            mine = [h.entry_id for h in self.held.values() if h.request_class == cls]
            gone = await self.ends.renew(request_class=cls, consumer=self.config.consumer,
                                         entry_ids=mine)
            for entry_id in gone:
                self._give_up_entry(cls, entry_id)
            _, claimed, _ = await self.redis.xautoclaim(
                stream, queue.ROUTER_GROUP, self.config.consumer, self.config.claim_idle_ms,
                start_id="0-0", count=self.config.prefetch)
            for entry_id, fields in claimed:
                if fields and (cls, entry_id) not in self.held:
                    deliveries = await self._deliveries(stream, entry_id)
                    log.warning("took over %s entry %s from a stopped router (delivery %d)",
                                cls, entry_id, deliveries)
                    self._hold(cls, entry_id, fields)
                    held = self.held.get((cls, entry_id))
                    if held is not None:
                        held.progress.delivery = max(1, deliveries)
                    if held is not None and deliveries > queue.MAX_DELIVERIES:
                        held.progress.give_up = (f"request delivered to {deliveries} routers "
                                                 "without ending")
        self._dispatch_ready()

    def _give_up_entry(self, cls: str, entry_id: str) -> None:
        """An entry waiting here is another router's now (this one stalled past claim_idle_ms)
        or gone: never run here. A running one is left to its end script, which refuses it
        (and its entry may just have been acknowledged by _finish); aborting it by request id
        could abort the new owner's attempt on the same worker."""
        held = self.held.get((cls, entry_id))
        if held is None or held.dropped or held.progress.entry.request_id in self.running:
            return
        log.warning("request %s: its %s entry %s is no longer this router's (taken over after a "
                    "stall, or gone); letting it go", held.progress.entry.request_id, cls, entry_id)
        self._drop(held)

    def _drop(self, held: Held) -> bool:
        """Never to run (or end) here; returns whether it is running now. One that waits is
        forgotten at once, so the entry can be held again if it comes back to this router."""
        held.dropped = True
        key = (held.request_class, held.entry_id)
        running = held.progress.entry.request_id in self.running
        if not running and self.held.get(key) is held:
            del self.held[key]
        return running

    async def _deliveries(self, stream: str, entry_id: str) -> int:
        """How many times the group delivered the entry (counted by Redis, across routers)."""
        info = await self.redis.xpending_range(stream, queue.ROUTER_GROUP, min=entry_id,
                                               max=entry_id, count=1)
        return int(info[0]["times_delivered"]) if info else 0

    async def _pick(self, entry: queue.QueueEntry, resuming: bool = False) -> WorkerHandle:
        started = time.monotonic()
        while True:
            if resuming:
                candidates = self.registry.serving()
            elif entry.request_class == RequestClass.INTERACTIVE:
                candidates = self.registry.available(self.config.class_policy.batch_min_share)
            else:
                candidates = self.registry.available()
            worker = place(self.policy, entry, candidates,
                           list(self.registry.workers.values()), time.monotonic() - started)
            if worker is not None:
                self.policy.on_dispatched(entry, worker)
                return worker
            if entry.deadline_unix_ns and time.time_ns() >= entry.deadline_unix_ns:
                served = any(h.model_state(entry.model) for h in self.registry.workers.values())
                raise RequestFailed("DEADLINE_EXCEEDED", (
                    f"no worker serving model {entry.model!r} had room before the deadline"
                    if served else f"no live worker serves model {entry.model!r}"))
            self._slot_freed.clear()
            await wait_event(self._slot_freed, 0.5)

    async def watch_cancels(self) -> None:
        """Abort requests whose client went away (the gateway publishes their ids)."""
        while True:
            try:
                pubsub = self.redis.pubsub()
                await pubsub.subscribe(queue.CANCEL_CHANNEL)
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    held = self.running.get(message["data"])
                    if held is not None:
                        asyncio.create_task(self._abort_on_worker(held.progress))
            except RedisError as exc:
                log.warning("cancel channel lost (%s); resubscribing", exc)
                await asyncio.sleep(0.5)

    async def _abort_on_worker(self, p: RequestProgress) -> None:
        """Abort the request on its worker; retried briefly because the cancel can race the
        worker's admission of the request (Abort answers False until the worker knows it)."""
        p.cancelled = True
        for _ in range(20):
            handle = self.registry.workers.get(p.worker_ids[-1]) if p.worker_ids else None
            if handle is not None:
                with contextlib.suppress(Exception):
                    reply = await handle.stub.Abort(
                        worker_pb2.AbortRequest(request_id=p.entry.request_id), timeout=1.0)
                    if reply.aborted:
                        return
            if p.entry.request_id not in self.running:
                return
            await asyncio.sleep(0.05)
