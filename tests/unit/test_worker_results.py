"""WorkerServicer with a real Redis and a tiny random model: a request that names a result stream
gets its tokens appended there by the worker (and listed in the final message), a request that
does not gets them in the gRPC stream, and a worker whose index was already written stops."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from opentelemetry import trace

from llmmesh import queue
from llmmesh.errors import Aborted, AlreadyExists
from llmmesh.streamauth import attempt_key, attempt_number
from llmmesh.v1 import common_pb2, worker_pb2
from tests.unit.test_engine import engine_config, model  # noqa: F401 (fixture)
from workers.engine import AsyncEngine
from workers.hosting import SingleModelHost
from workers.servicer import WorkerServicer


class _Tokenizer:
    """Each token decodes to `<id>`, so a stop string can name one token of the output."""

    stop_token_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


class _Context:
    def invocation_metadata(self):
        return ()


def _request(rid: str, stream: str = "", cls=common_pb2.REQUEST_CLASS_INTERACTIVE, stop=(),
             delivered=()):
    """`delivered`: tokens earlier attempts delivered (a retry's prompt ends with them)."""
    return worker_pb2.WorkerGenerateRequest(
        request_id=rid, tenant_id="t", model="tiny", prompt_token_ids=[5, 6, 7, 8, 9, *delivered],
        sampling=common_pb2.SamplingParams(max_tokens=6 - len(delivered), temperature=0,
                                           stop=list(stop)),
        request_class=cls, result_stream=stream, start_index=len(delivered),
        num_original_prompt_tokens=5)


def _run(model, redis_url: str, *requests):
    async def main():
        engine = AsyncEngine(engine_config(), model, name="tiny")
        await engine.start()
        redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
        servicer = WorkerServicer(SingleModelHost(engine, _Tokenizer(), "tiny", "fp32"), "w0", "cpu",
                                  trace.get_tracer("test"), results=redis)
        out = []
        try:
            for req in requests:
                try:
                    out.append([m async for m in servicer.Generate(req, _Context())])
                except Aborted as exc:
                    out.append(exc)
            streams = {req.result_stream: await redis.xrange(req.result_stream)
                       for req in requests if req.result_stream}
        finally:
            await redis.aclose()
            await engine.shutdown()
        return out, streams
    return asyncio.run(main())


def test_worker_appends_tokens_to_the_named_stream_and_lists_them_in_the_final(model, redis_server):
    stream = queue.result_stream("direct")
    (to_redis, in_grpc), streams = _run(model, redis_server.url, _request("a", stream), _request("b"))
    # Named stream: the gRPC stream holds only the final, which lists this attempt's tokens.
    assert [m.WhichOneof("kind") for m in to_redis] == ["final"]
    written = list(to_redis[0].final.token_ids)
    assert len(written) == to_redis[0].final.usage.completion_tokens >= 1
    events = streams[stream]
    assert [entry_id for entry_id, _ in events] == [queue.token_entry_id(i)
                                                    for i in range(len(written))]
    assert [queue.decode_event(f)["ids"][0] for _, f in events] == written
    # Only the last chunk carries the end marker, which says what the final says.
    ends = [queue.decode_event(f).get("end") for _, f in events]
    assert ends[:-1] == [None] * (len(ends) - 1)
    assert ends[-1]["finish_reason"] == "length"      # tiny random model, max_tokens=6
    assert to_redis[0].final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert ends[-1]["usage"]["decode_device_s"] == pytest.approx(
        to_redis[0].final.usage.decode_device_seconds)
    # No stream named: every token in the gRPC stream, nothing listed in the final.
    assert [m.WhichOneof("kind") for m in in_grpc] == ["tokens"] * len(written) + ["final"]
    assert [m.tokens.token_ids[0] for m in in_grpc[:-1]] == written   # same greedy output
    assert list(in_grpc[-1].final.token_ids) == []


def test_worker_stops_when_its_index_was_already_written(model, redis_server):
    stream = queue.result_stream("taken")

    async def occupy():
        r = aioredis.Redis.from_url(redis_server.url)
        await queue.append_tokens(r, stream, 3, [1])   # a later attempt got further
        await r.aclose()
    asyncio.run(occupy())
    (outcome,), streams = _run(model, redis_server.url, _request("c", stream))
    assert isinstance(outcome, Aborted) and "index 0 was already delivered" in str(outcome)
    assert [entry_id for entry_id, _ in streams[stream]] == [queue.token_entry_id(3)]


def test_stop_string_ends_the_stream_at_its_token_with_an_empty_marked_last_chunk(model, redis_server):
    """A stop string completed by the 3rd token: the stream holds exactly 3 tokens (none the
    engine made before the abort took effect), then an empty chunk whose end marker says stop;
    the final says stop too. The same request without the stop runs to max_tokens (6)."""
    (plain,), _ = _run(model, redis_server.url, _request("p", queue.result_stream("p")))
    full = list(plain[-1].final.token_ids)
    assert len(full) == 6
    stream = queue.result_stream("s")
    (stopped,), streams = _run(model, redis_server.url,
                               _request("s", stream, stop=[f"<{full[2]}>"]))
    # A token id may repeat: the stop matches at its first occurrence.
    first = full.index(full[2]) + 1
    assert list(stopped[-1].final.token_ids) == full[:first]
    assert stopped[-1].final.finish_reason == common_pb2.FINISH_REASON_STOP
    events = [queue.decode_event(f) for _, f in streams[stream]]
    assert [i for e in events for i in e["ids"]] == full[:first]
    assert events[-1]["ids"] == [] and events[-1]["end"]["finish_reason"] == "stop"
    assert all("end" not in e for e in events[:-1])


def test_stop_string_completed_by_the_last_allowed_token_still_says_stop(model, redis_server):
    """The 6th token (max_tokens=6) completes the stop string: the request ends there either
    way, but its finish reason is stop, not length."""
    (plain,), _ = _run(model, redis_server.url, _request("q", queue.result_stream("q")))
    full = list(plain[-1].final.token_ids)
    assert plain[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert full[-1] not in full[:-1]   # the stop string first appears with the last token
    (stopped,), _ = _run(model, redis_server.url,
                         _request("r", queue.result_stream("r"), stop=[f"<{full[-1]}>"]))
    assert list(stopped[-1].final.token_ids) == full
    assert stopped[-1].final.finish_reason == common_pb2.FINISH_REASON_STOP


def test_retry_whose_delivered_tokens_hold_the_stop_ends_at_once(model, redis_server):
    """An attempt broke off after delivering the token that completed a stop string but before
    its end marker: the retry sees the delivered tokens, generates nothing and ends as stop.
    A retry whose delivered tokens do not hold it generates on (the rest of the 6)."""
    (plain,), _ = _run(model, redis_server.url, _request("u", queue.result_stream("u")))
    full = list(plain[-1].final.token_ids)
    stop = f"<{full[1]}>"
    stream = queue.result_stream("v")
    (retry,), streams = _run(model, redis_server.url,
                             _request("v", stream, stop=[stop], delivered=full[:2]))
    assert retry[-1].final.finish_reason == common_pb2.FINISH_REASON_STOP
    assert list(retry[-1].final.token_ids) == []
    (event,) = [queue.decode_event(f) for _, f in streams[stream]]
    assert event["index"] == 2 and event["ids"] == [] and event["end"]["finish_reason"] == "stop"
    (other,), _ = _run(model, redis_server.url,
                       _request("w", queue.result_stream("w"), stop=["<nope>"], delivered=full[:2]))
    assert list(other[-1].final.token_ids) == full[2:]


def test_a_newer_attempt_replaces_the_older_one_still_running_here(model, redis_server):
    """A router killed mid-request leaves its attempt running on the worker until its call is torn
    down; the router that takes the entry over sends a newer attempt (higher number) to the same
    worker. The newer one replaces the older (aborted, writes nothing more) and completes from
    where the stream stands; the same attempt number again, or an older one, gets ALREADY_EXISTS
    and leaves the running attempt alone."""
    stream, key = queue.result_stream("replaced"), "ab" * 16
    first, second = attempt_number(1, 0), attempt_number(2, 0)

    def req(number, delivered=(), max_tokens=400):
        r = _request("x", stream, delivered=delivered)
        r.sampling.max_tokens = max_tokens
        r.attempt, r.attempt_key = number, attempt_key(key, number)
        return r

    async def main():
        engine = AsyncEngine(engine_config(), model, name="tiny")
        await engine.start()
        redis = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        servicer = WorkerServicer(SingleModelHost(engine, _Tokenizer(), "tiny", "fp32"), "w0", "cpu",
                                  trace.get_tracer("test"), results=redis)

        async def run(r):
            try:
                return [m async for m in servicer.Generate(r, _Context())]
            except (Aborted, AlreadyExists) as exc:
                return exc
        try:
            old = asyncio.create_task(run(req(first)))
            while not await redis.xlen(stream):
                await asyncio.sleep(0.005)
            # Not newer: refused, and the running attempt goes on.
            assert isinstance(await run(req(first)), AlreadyExists)
            assert isinstance(await run(req(first - 1)), AlreadyExists)
            assert not old.done()
            # As a router's takeover does: send on from what the stream holds. The old attempt may
            # write on until it is replaced; the new one then finds its index taken, and the
            # router reads the stream again and sends the next attempt.
            for number in (second, second + 1, second + 2):
                delivered = [i for _, f in await redis.xrange(stream)
                             for i in queue.decode_event(f)["ids"]]
                new = await run(req(number, delivered=delivered, max_tokens=3))
                if not (isinstance(new, Aborted) and "already delivered" in str(new)):
                    break
            replaced = await old
            events = [queue.decode_event(f) for _, f in await redis.xrange(stream)]
            return new, replaced, events
        finally:
            await redis.aclose()
            await engine.shutdown()

    new, replaced, events = asyncio.run(main())
    assert isinstance(replaced, Aborted) and "replaced attempt" in str(replaced)
    assert not isinstance(new, Exception), new
    assert new[-1].final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    # One contiguous completion: the old attempt's chunks, then the new one's 3 tokens and its end.
    indexes = [e["index"] for e in events]
    assert indexes == sorted(set(indexes))
    by_attempt = [e["a"] for e in events]
    assert by_attempt[0] == first and by_attempt[-1] > first
    assert by_attempt == sorted(by_attempt)
    assert [e for e in events if "end" in e] == events[-1:]
    assert sum(len(e["ids"]) for e in events if e["a"] == by_attempt[-1]) == 3
