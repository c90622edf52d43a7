"""WorkerService: a thin edge over AsyncEngine (proto <-> domain, stop strings, spans)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from opentelemetry import trace
from redis.exceptions import RedisError

from llmmesh import queue, telemetry, vocab
from llmmesh.aio import wait_event
from llmmesh.errors import (Aborted, AlreadyExists, DeadlineExceeded, Internal, InvalidArgument,
                            NotFound, Unavailable)
from llmmesh.tokenizer import IncrementalDetokenizer
from llmmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from llmmesh.vocab import FinishReason, RequestClass
from workers.engine.outputs import RequestUsage
from workers.engine.request import Priority
from workers.engine.sampling import SamplingParams

# Batch-class tokens travel in chunks: nobody watches them arrive one by one, and every message
# costs CPU in this worker, Redis and the gateway, which on a shared host is taken from the
# engine's steps. A chunk goes out at this many tokens or this age, and always
# before the final. Interactive tokens go out as they come.
BATCH_CHUNK_TOKENS = 16
BATCH_CHUNK_S = 0.25

# How long a newer attempt waits for the older attempt it replaces to leave the engine (one step,
# normally) before it gives up with ALREADY_EXISTS.
REPLACE_WAIT_S = 5.0


@dataclass
class _Attempt:
    """The attempt of a request that runs on this worker. `engine_id`: the request's id in the
    engine, one per attempt, so that an abort meant for an old attempt never reaches the new
    one. `replaced`: a newer attempt took its place; it writes nothing more to the result
    stream."""
    number: int
    engine_id: str
    replaced: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)


def _end_marker(reason: str, usage) -> dict:
    """The `end` of a worker's last result-stream chunk: what the router's final would say."""
    return {"finish_reason": FinishReason.of(reason).value,
            "usage": {"cached_prompt_tokens": usage.cached_prompt_tokens,
                      "prefill_device_s": usage.prefill_device_s,
                      "decode_device_s": usage.decode_device_s, "queue_s": usage.queue_s,
                      "prefill_s": usage.prefill_s}}


class StopStringMatcher:
    """Finds client stop strings in the decoded completion (token-level stops live in the engine)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.stop = stop
        self.detok = IncrementalDetokenizer(tokenizer) if stop else None
        self.text = ""
        self.matched = False

    def push(self, token_ids: list[int]) -> bool:
        """True the first time the completion contains a stop string."""
        if self.detok is None or self.matched:
            return False
        self.text += self.detok.push(token_ids)
        tail = self.text[-(max(map(len, self.stop)) + 64):]
        self.matched = any(s in tail for s in self.stop)
        return self.matched


def _sampling(s: common_pb2.SamplingParams, stop_token_ids) -> SamplingParams:
    if s.max_tokens < 1:
        raise InvalidArgument("sampling.max_tokens", f"must be >= 1, got {s.max_tokens}")
    return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p or 1.0,
                          top_k=s.top_k, seed=s.seed if s.HasField("seed") else None,
                          stop_token_ids=tuple(stop_token_ids), logprobs=s.logprobs)


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, host, worker_id: str, device_type: str, tracer: trace.Tracer,
                 results=None):
        # host: workers.hosting.ModelHost (or SingleModelHost): the models, loaded on demand.
        self.host, self.engine = host, host.engine
        # Redis client (redis.asyncio) for requests that name a result stream; None: tokens
        # always travel in the gRPC stream.
        self.results = results
        self.worker_id, self.device_type = worker_id, device_type
        self.tracer = tracer
        self.num_requests_total = 0
        self.num_prompt_tokens_total = 0
        self.num_cached_prompt_tokens_total = 0
        self._attempts: dict[str, _Attempt] = {}   # request id -> the attempt running here

    async def _take_place(self, request) -> _Attempt:
        """Register this attempt of the request. An older attempt still running here (its router
        died, or gave the entry up, and its call has not been torn down yet) is replaced: a
        takeover's attempt number is higher (llmmesh.streamauth.attempt_number). The older one is
        aborted and writes nothing more. The same or an older attempt gets ALREADY_EXISTS."""
        rid = request.request_id
        while (old := self._attempts.get(rid)) is not None:
            if not request.attempt_key or request.attempt <= old.number:
                raise AlreadyExists(f"request_id {rid!r} is already in flight on this worker "
                                    f"(attempt {old.number})")
            old.replaced = True
            self.engine.abort(old.engine_id)
            if not await wait_event(old.ended, REPLACE_WAIT_S):
                raise AlreadyExists(f"request_id {rid!r}: attempt {old.number} did not leave this "
                                    f"worker within {REPLACE_WAIT_S:.0f} s")
        engine_id = f"{rid}#{request.attempt}" if request.attempt_key else rid
        self._attempts[rid] = attempt = _Attempt(request.attempt, engine_id)
        return attempt

    async def Generate(self, request, context):
        if request.model not in self.host.servable():
            raise NotFound(f"model {request.model!r} is not served by worker {self.worker_id}; "
                           f"it serves: {', '.join(self.host.servable())}")
        if not request.prompt_token_ids:
            raise InvalidArgument("prompt_token_ids", "must not be empty")
        if request.deadline_unix_ns and time.time_ns() >= request.deadline_unix_ns:
            raise DeadlineExceeded("deadline passed before the worker started the request")
        parent = telemetry.extract_context(dict(context.invocation_metadata() or ()))
        operation = request.operation or vocab.TEXT_COMPLETION
        attempt = await self._take_place(request)
        try:
            async for msg in self._generate(request, attempt, operation, parent):
                yield msg
        finally:
            if self._attempts.get(request.request_id) is attempt:
                del self._attempts[request.request_id]
            attempt.ended.set()

    async def _generate(self, request, attempt: _Attempt, operation: str, parent):
        # Loads the model first when it is not loaded here (within the request's deadline).
        async with self.host.use(request.model, request.deadline_unix_ns) as hosted:
            sampling = _sampling(request.sampling, hosted.tokenizer.stop_token_ids)
            self.num_requests_total += 1
            with self.tracer.start_as_current_span(telemetry.span_name(operation, request.model),
                                                   context=parent, kind=trace.SpanKind.SERVER) as span:
                span.set_attributes({vocab.OPERATION: operation,
                                     vocab.PROVIDER: vocab.PROVIDER_NAME,
                                     vocab.REQUEST_MODEL: request.model,
                                     vocab.RESPONSE_MODEL: request.model,
                                     vocab.TENANT_ID: request.tenant_id,
                                     vocab.REQUEST_ID: request.request_id,
                                     vocab.WORKER_ID: self.worker_id,
                                     vocab.DEVICE_TYPE: self.device_type,
                                     vocab.QUANTIZATION: hosted.quantization})
                async for msg in self._stream(request, attempt, sampling, span, hosted.tokenizer):
                    yield msg

    async def _stream(self, request, attempt: _Attempt, sampling, span, tokenizer):
        matcher = StopStringMatcher(tokenizer, list(request.sampling.stop))
        index = request.start_index
        # Tokens go straight to the request's result stream when it names one (one hop less
        # per token than relaying them through the router).
        stream = request.result_stream if self.results is not None else ""
        # Every chunk names this attempt and is signed with its key, so the gateway relays it
        # only while this attempt is the current one (llmmesh.streamauth).
        signer = (request.attempt, request.attempt_key) if request.attempt_key else (None, None)
        # A retry continues after the tokens earlier attempts delivered (the prompt's last
        # start_index tokens): stop strings see them too, and one that already matched (its
        # attempt broke off before its end marker) ends the request here.
        if index > 0 and matcher.push(list(request.prompt_token_ids[-index:])):
            usage = RequestUsage(len(request.prompt_token_ids), 0, 0, 0.0, 0.0, 0.0)
            if stream:
                await self._append(stream, index, [], [], signer,
                                   end=_end_marker(FinishReason.STOP, usage))
            yield self._final(FinishReason.STOP, usage, span)
            return
        request_class = RequestClass.from_proto(request.request_class)
        priority = Priority(request_class.priority)
        outputs = self.engine.generate(attempt.engine_id, list(request.prompt_token_ids), sampling,
                                       priority=priority, cache_salt=request.cache_salt,
                                       model=request.model, tenant=request.tenant_id,
                                       resumed=request.start_index > 0)
        ids: list[int] = []
        logprobs: list[float] = []
        oldest = 0.0
        written: list[int] = []   # appended to the result stream by this attempt
        try:
            async for out in outputs:
                if attempt.replaced:
                    raise Aborted(f"worker {self.worker_id}: a newer attempt of request "
                                  f"{request.request_id} replaced attempt {attempt.number}")
                # Tokens the engine made after a stop string matched (before the abort took
                # effect) are dropped: the completion ends with the token that completed it.
                if out.new_token_ids and not matcher.matched:
                    if not ids:
                        oldest = time.monotonic()
                    ids += out.new_token_ids
                    logprobs += out.new_logprobs or []
                    if matcher.push(out.new_token_ids) and not out.finished:
                        self.engine.abort(attempt.engine_id)  # its final arrives as cancelled
                if out.finished and out.finish_reason == FinishReason.ERROR:
                    # An engine failure, not the request's fault: the router retries elsewhere
                    # (from the tokens it already relayed; a held chunk is computed again).
                    raise Internal(f"engine error on worker {self.worker_id}: {out.error}")
                reason = (FinishReason.STOP if matcher.matched else out.finish_reason) if out.finished else None
                if reason or (ids and (request_class == RequestClass.INTERACTIVE or matcher.matched
                                       or len(ids) >= BATCH_CHUNK_TOKENS
                                       or time.monotonic() - oldest >= BATCH_CHUNK_S)):
                    if stream:
                        # The last chunk (tokens or not) carries the end marker, so a router
                        # that takes the request over does not run it on (see tokens_event).
                        end = _end_marker(reason, out.usage) if reason else None
                        await self._append(stream, index, ids, logprobs, signer, end=end)
                        written += ids
                    elif ids:
                        yield worker_pb2.WorkerGenerateResponse(tokens=worker_pb2.WorkerTokens(
                            index=index, token_ids=ids, logprobs=logprobs))
                    index += len(ids)
                    ids, logprobs = [], []
                if reason:
                    final = self._final(reason, out.usage, span)
                    final.final.token_ids.extend(written)
                    yield final
                    return
        finally:
            await outputs.aclose()

    async def _append(self, stream: str, index: int, ids: list[int], logprobs: list[float],
                      signer: tuple[int | None, bytes | None], end: dict | None = None) -> None:
        try:
            await queue.append_tokens(self.results, stream, index, ids, logprobs, end, *signer)
        except queue.IndexTaken as exc:
            # Another attempt owns this request now: stop (the engine aborts it on close).
            raise Aborted(f"worker {self.worker_id}: {exc}") from exc
        except RedisError as exc:
            raise Unavailable(f"worker {self.worker_id} cannot write the result stream "
                              f"({type(exc).__name__}); retry") from exc

    def _final(self, reason: str, usage, span) -> worker_pb2.WorkerGenerateResponse:
        self.num_prompt_tokens_total += usage.prompt_tokens
        self.num_cached_prompt_tokens_total += usage.cached_prompt_tokens
        span.set_attributes({vocab.INPUT_TOKENS: usage.prompt_tokens,
                             vocab.OUTPUT_TOKENS: usage.completion_tokens,
                             vocab.CACHE_READ_TOKENS: usage.cached_prompt_tokens,
                             vocab.PREFILL_DEVICE_S: usage.prefill_device_s,
                             vocab.DECODE_DEVICE_S: usage.decode_device_s,
                             vocab.FINISH_REASONS: [str(reason)]})
        return worker_pb2.WorkerGenerateResponse(final=worker_pb2.WorkerFinal(
            finish_reason=FinishReason.of(reason).proto,
            usage=common_pb2.Usage(
                prompt_tokens=usage.prompt_tokens, cached_prompt_tokens=usage.cached_prompt_tokens,
                completion_tokens=usage.completion_tokens,
                prefill_device_seconds=usage.prefill_device_s,
                decode_device_seconds=usage.decode_device_s, queue_seconds=usage.queue_s,
                prefill_seconds=usage.prefill_s)))

    async def Abort(self, request, context):
        attempt = self._attempts.get(request.request_id)
        return worker_pb2.AbortResponse(aborted=self.engine.abort(
            attempt.engine_id if attempt else request.request_id))

    async def GetLoad(self, request, context):
        """Totals over the loaded models, and each servable model's state (what routers place
        by: loaded, loading or unloaded, its load and its measured cold start)."""
        states = self.host.states()
        loads = self.engine.loads()
        loaded = [s for s in states if s.state == "loaded"]
        first = loaded[0] if loaded else None
        return worker_pb2.GetLoadResponse(
            num_running=sum(x.num_running for x in loads.values()),
            num_waiting=sum(x.num_waiting for x in loads.values()),
            num_free_blocks=sum(x.num_free_blocks for x in loads.values()),
            num_total_blocks=sum(x.num_total_blocks for x in loads.values()),
            block_size=next(iter(loads.values())).block_size if loads else 0,
            models=[s.name for s in loaded], device_type=self.device_type,
            quantization=first.quantization if first else "",
            context_length=first.context_length if first else 0,
            num_requests_total=self.num_requests_total,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_cached_prompt_tokens_total=self.num_cached_prompt_tokens_total,
            model_states=states, memory_budget_bytes=self.host.memory_budget_bytes,
            memory_used_bytes=self.host.used_bytes())
