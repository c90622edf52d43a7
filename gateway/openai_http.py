"""The OpenAI-compatible HTTP front: the clients product teams already have, on the mesh's own
admission path.

`/v1/chat/completions`, `/v1/completions`, `/v1/models`, the Batch API (`/v1/files`,
`/v1/batches`) and `/health`, served by uvicorn in the gateway's event loop beside the gRPC
server. A request is translated into the gRPC front's GenerateRequest and goes through the same
validation, the same Frontend (admission, enqueue, relay) and the same batch jobs: one tenant
book, one tokenizer, one bill. Only the shapes differ, and the error table below.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field

import grpc
import uvicorn
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.batch_jobs import BatchJobs
from gateway.frontend import Admitted, FinalOut, Frontend, TokensOut
from gateway.tenants import Tenant, TenantBook
from gateway.textstream import TextStream
from gateway.models import describe, live_states
from gateway.validation import ServedModel, ValidRequest, validate
from llmmesh import vocab
from llmmesh.errors import InvalidArgument, MeshError, NotFound, ResourceExhausted
from llmmesh.v1 import common_pb2, gateway_pb2
from llmmesh.vocab import CLASSES, FinishReason, RequestClass

log = logging.getLogger("gateway.openai")

MAX_BODY_BYTES = 4 * 1024 * 1024        # one JSON request
MAX_FILE_BYTES = 64 * 1024 * 1024       # one batch input file (held in Redis for the job's TTL)
TIMEOUT_HEADER = "x-request-timeout"    # seconds: the request's deadline (504 past it)
CLASS_HEADER = "x-llmmesh-class"        # "interactive" | "batch", capped by the plan
CLIENT_ID_HEADER = "x-client-request-id"
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")

# gRPC status -> (HTTP status, OpenAI error type): the statuses the SDKs turn into typed errors.
_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
_CODES = {401: "invalid_api_key", 403: "model_not_allowed", 404: "not_found",
          409: "request_id_in_use", 429: "rate_limit_exceeded", 503: "service_unavailable",
          504: "deadline_exceeded"}
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}  # OpenAI's words
_INT32 = 2**31 - 1


# ---------------------------------------------------------------------------------------------
# Errors in OpenAI's shape

def error_body(etype: str, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def _error_of(exc: BaseException) -> tuple[int, dict, dict]:
    """(HTTP status, body, headers) for an error (parse() already named fields as the body does)."""
    headers: dict[str, str] = {}
    if isinstance(exc, RedisError):
        return 503, error_body("service_unavailable", "queue store unavailable; retry shortly",
                               code="service_unavailable"), {"retry-after": "1"}
    if isinstance(exc, HTTPException):   # Starlette's own refusals (a malformed multipart form)
        status = exc.status_code
        return status, error_body("invalid_request_error", str(exc.detail)), headers
    if not isinstance(exc, MeshError):
        log.exception("unhandled error in the HTTP front", exc_info=exc)
        return 500, error_body("server_error", "internal error; see the gateway's logs",
                               code="internal_error"), headers
    status, etype = _HTTP.get(exc.code, (500, "server_error"))
    message, param, code = exc.message, None, _CODES.get(status)
    if isinstance(exc, InvalidArgument):
        param = exc.field
        problem = exc.message.split(": ", 1)[1] if ": " in exc.message else exc.message
        message, code = f"{param}: {problem}", "invalid_value"
    if status == 404 and message.startswith("model "):
        code = "model_not_found"
    if isinstance(exc, ResourceExhausted):
        headers["retry-after"] = str(max(1, math.ceil(exc.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, int(exc.retry_after_s * 1000)))
        if "budget" in message:
            code = "insufficient_quota"
    return status, error_body(etype, message, param, code), headers


def _rename(field_path: str, params: dict) -> str:
    head, dot, rest = field_path.partition(".")
    return (params.get(head, head) + dot + rest) if dot else params.get(field_path, field_path)


def _error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = _error_of(exc)
    return JSONResponse(body, status_code=status, headers=headers)


# ---------------------------------------------------------------------------------------------
# Request bodies -> the gRPC front's GenerateRequest (so one validation applies to both doors)

def _type_name(v) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


def _get(body: dict, name: str, kinds: tuple, what: str):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise InvalidArgument(name, f"must be {what}, got {_type_name(v)}")
    return v


def _int(body: dict, name: str, lo: int, hi: int = _INT32) -> int | None:
    v = _get(body, name, (int,), "an integer")
    if v is not None and not lo <= v <= hi:
        raise InvalidArgument(name, f"must be in [{lo}, {hi}], got {v}")
    return v


def _num(body: dict, name: str) -> float | None:
    v = _get(body, name, (int, float), "a number")
    if v is not None and not math.isfinite(v):
        raise InvalidArgument(name, "must be a finite number")
    return v


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                raise InvalidArgument(f"{where}[{j}].type", f"only text parts are supported, got {kind!r}")
            if not isinstance(part.get("text"), str):
                raise InvalidArgument(f"{where}[{j}].text", "must be a string")
            parts.append(part["text"])
        return "\n".join(parts)
    raise InvalidArgument(where, f"must be a string or an array of text parts, got {_type_name(content)}")


def _unsupported(body: dict) -> None:
    """Parameters the engine does not offer: refused by name when they would change the answer,
    never silently ignored."""
    n = _int(body, "n", 1, _INT32)
    if n not in (None, 1):
        raise InvalidArgument("n", f"only n=1 is supported, got {n}; send {n} requests")
    for name in ("frequency_penalty", "presence_penalty"):
        if _num(body, name):
            raise InvalidArgument(name, "is not supported by this engine; leave it unset or 0")
    for name in ("tools", "functions", "logit_bias"):
        if body.get(name):
            raise InvalidArgument(name, "is not supported by this engine")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise InvalidArgument("response_format", "only {\"type\": \"text\"} is supported")
    if body.get("echo"):
        raise InvalidArgument("echo", "is not supported")
    if body.get("suffix"):
        raise InvalidArgument("suffix", "is not supported")
    best_of = _int(body, "best_of", 1)
    if best_of not in (None, 1):
        raise InvalidArgument("best_of", f"only best_of=1 is supported, got {best_of}")


@dataclass
class Options:
    """What the HTTP shape needs beyond the GenerateRequest."""
    chat: bool
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    user: str = ""
    params: dict = field(default_factory=dict)   # validation field -> the body's name for it


def to_request(body, chat: bool, headers=None) -> tuple[gateway_pb2.GenerateRequest, Options]:
    """One OpenAI request body as a GenerateRequest; InvalidArgument names the body's field."""
    if not isinstance(body, dict):
        raise InvalidArgument("body", f"must be a JSON object, got {_type_name(body)}")
    headers = headers or {}
    opts = Options(chat=chat)
    opts.params = {"prompt": "messages" if chat else "prompt", "request_id": CLIENT_ID_HEADER,
                   "sampling.temperature": "temperature", "sampling.top_p": "top_p",
                   "sampling.top_k": "top_k", "sampling.stop": "stop", "sampling.seed": "seed",
                   "sampling.max_tokens": "max_tokens", "request_class": "service_tier"}
    _unsupported(body)
    req = gateway_pb2.GenerateRequest(model=_get(body, "model", (str,), "a string") or "")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidArgument("messages", "must be a non-empty array of messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise InvalidArgument(f"messages[{i}]", f"must be an object, got {_type_name(m)}")
            role = m.get("role")
            role = "system" if role == "developer" else role
            if role in ("tool", "function"):
                raise InvalidArgument(f"messages[{i}].role", f"{role} messages are not supported "
                                      "(no tool calling)")
            if not isinstance(role, str):
                raise InvalidArgument(f"messages[{i}].role", "must be a string")
            content = m.get("content")
            req.messages.add(role=role, content=_text_of(content, f"messages[{i}].content")
                             if content is not None else "")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list):
            raise InvalidArgument("prompt", "one prompt (a string) per request")
        if not isinstance(prompt, str):
            raise InvalidArgument("prompt", f"must be a string, got {_type_name(prompt)}")
        req.prompt = prompt

    s = req.sampling
    for name in ("max_completion_tokens", "max_tokens"):
        v = _int(body, name, 1)
        if v is not None:
            s.max_tokens = v
            opts.params["sampling.max_tokens"] = name
            break
    for name in ("temperature", "top_p"):
        v = _num(body, name)
        if v is not None:
            setattr(s, name, v)
    s.temperature = s.temperature if body.get("temperature") is not None else 1.0
    top_k = _int(body, "top_k", 0)     # vLLM's extension, same meaning
    if top_k:
        s.top_k = top_k
    seed = _int(body, "seed", 0, 2**64 - 1)
    if seed is not None:
        s.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise InvalidArgument("stop", "must be a string or an array of strings")
        s.stop.extend(stop)
    if chat:
        opts.logprobs = bool(_get(body, "logprobs", (bool,), "a boolean"))
        top = _int(body, "top_logprobs", 0, 20)
        if top:
            raise InvalidArgument("top_logprobs", "the engine returns the chosen token's logprob "
                                  "only; use logprobs=true with top_logprobs 0 or unset")
    else:
        lp = _int(body, "logprobs", 0, 5)
        if lp:
            raise InvalidArgument("logprobs", "only 0 (the chosen token's logprob) is offered; "
                                  "alternatives are not")
        opts.logprobs = lp == 0
    s.logprobs = opts.logprobs
    opts.stream = bool(_get(body, "stream", (bool,), "a boolean"))
    so = _get(body, "stream_options", (dict,), "an object") or {}
    if so and not opts.stream:
        raise InvalidArgument("stream_options", "only allowed with stream=true")
    opts.include_usage = bool(so.get("include_usage"))
    opts.user = _get(body, "user", (str,), "a string") or ""

    tier = _get(body, "service_tier", (str,), "a string")
    if tier not in (None, "auto", "default", "flex", "priority"):
        raise InvalidArgument("service_tier", f"must be auto, default, flex or priority, got {tier!r}")
    req.request_class = {"flex": RequestClass.BATCH.proto,
                         "priority": RequestClass.INTERACTIVE.proto}.get(
                             tier, common_pb2.REQUEST_CLASS_UNSPECIFIED)
    header_class = headers.get(CLASS_HEADER)
    if header_class is not None:
        if header_class not in CLASSES:
            raise InvalidArgument(CLASS_HEADER, f"must be one of {', '.join(CLASSES)}, "
                                                f"got {header_class!r}")
        req.request_class = RequestClass(header_class).proto
    req.request_id = headers.get(CLIENT_ID_HEADER, "")
    return req, opts


def parse(body, chat: bool, models: dict[str, ServedModel], default_model: str,
          headers=None) -> tuple[ValidRequest, Options]:
    """to_request + the gRPC front's validation, with its field names renamed to the body's."""
    opts = None
    try:
        req, opts = to_request(body, chat, headers)
        return validate(req, models, default_model), opts
    except InvalidArgument as exc:
        if opts is None:
            raise
        problem = exc.message.split(": ", 1)[1]
        raise InvalidArgument(opts.params.get(exc.field) or _rename(exc.field, opts.params),
                              problem) from exc


def deadline_ns(headers) -> int:
    raw = headers.get(TIMEOUT_HEADER)
    if raw is None:
        return 0
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidArgument(TIMEOUT_HEADER, f"must be a positive number of seconds, got {raw!r}")
    return time.time_ns() + int(seconds * 1e9)


# ---------------------------------------------------------------------------------------------
# Response shapes

def usage_body(usage: dict) -> dict:
    p, c = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": usage.get("cached_prompt_tokens", 0)}}


def _tier(request_class: str) -> str:
    return "flex" if request_class == RequestClass.BATCH else "default"


class Shape:
    """Builds one request's OpenAI objects (chat or text completion, whole or as chunks)."""

    def __init__(self, opts: Options, model: ServedModel, client_id: str):
        self.chat, self.model, self.opts = opts.chat, model, opts
        self.id = ("chatcmpl-" if opts.chat else "cmpl-") + client_id
        self.created = int(time.time())
        self.tier = "default"
        self._prefix = ""

    def start(self, request_class: str) -> None:
        self.tier = _tier(request_class)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        # Every chunk shares this head: built once, the per-token work is one json.dumps.
        self._prefix = (f'data: {{"id":{json.dumps(self.id)},"object":"{obj}",'
                        f'"created":{self.created},"model":{json.dumps(self.model.name)},'
                        f'"service_tier":"{self.tier}","system_fingerprint":null,"choices":[')

    def _logprobs(self, token_ids: list[int], logprobs: list[float]):
        if not self.opts.logprobs:
            return None
        tokens = [self.model.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
        if self.chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                 "top_logprobs": []} for t, lp in zip(tokens, logprobs)]}
        return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None,
                "text_offset": []}

    def role_chunk(self) -> bytes:
        return (self._prefix + '{"index":0,"delta":{"role":"assistant","content":""},'
                '"logprobs":null,"finish_reason":null}]}\n\n').encode()

    def chunk(self, out: TokensOut) -> bytes:
        lp = "null"
        if self.opts.logprobs and out.token_ids:
            lp = json.dumps(self._logprobs(out.token_ids, out.logprobs))
        if self.chat:
            body = f'{{"index":0,"delta":{{"content":{json.dumps(out.text)}}},"logprobs":{lp},'
        else:
            body = f'{{"index":0,"text":{json.dumps(out.text)},"logprobs":{lp},'
        return (self._prefix + body + '"finish_reason":null}]}\n\n').encode()

    def finish_chunk(self, final: FinalOut) -> bytes:
        reason = _FINISH.get(final.finish_reason, "stop")
        delta = '"delta":{},' if self.chat else '"text":"",'
        data = self._prefix + f'{{"index":0,{delta}"logprobs":null,"finish_reason":"{reason}"}}]}}\n\n'
        if self.opts.include_usage:
            data += self._prefix + f']' + f',"usage":{json.dumps(usage_body(final.usage))}}}\n\n'
        return data.encode()

    def whole(self, text: str, token_ids: list[int], logprobs: list[float], final: FinalOut) -> dict:
        reason = _FINISH.get(final.finish_reason, "stop")
        choice = {"index": 0, "logprobs": self._logprobs(token_ids, logprobs), "finish_reason": reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        else:
            choice["text"] = text
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model.name, "choices": [choice],
                "usage": usage_body(final.usage), "service_tier": _tier(final.request_class),
                "system_fingerprint": None}


def sse_error(exc: BaseException) -> bytes:
    _, body, _ = _error_of(exc)
    return f"data: {json.dumps(body)}\n\n".encode()


# ---------------------------------------------------------------------------------------------
# One generation, run inside the ASGI call

class Generation:
    """Runs one request in the ASGI call's own task: the gateway's span, the relay and a watcher
    of the client's connection share it. The status line waits for admission, so a refusal is a
    real 429/403/400, not an error inside a 200 stream; a client that disconnects (or times out)
    cancels the task, which cancels the request on the worker exactly as a gRPC cancel does."""

    def __init__(self, frontend: Frontend, tenant: Tenant, valid: ValidRequest, opts: Options,
                 deadline: int):
        self.frontend, self.tenant, self.valid, self.opts = frontend, tenant, valid, opts
        self.deadline = deadline
        self.shape = Shape(opts, valid.model, valid.request_id)
        self.client_gone = False
        self.finishing = False
        self.request_id = ""

    def _events(self):
        attrs = {vocab.HTTP_ROUTE: "/v1/chat/completions" if self.opts.chat else "/v1/completions"}
        if self.opts.user:
            attrs[vocab.END_USER] = self.opts.user[:128]
        return self.frontend.generate(self.tenant, self.valid, self.deadline, announce=True,
                                      span_attributes=attrs)

    async def __call__(self, scope, receive, send):
        task = asyncio.current_task()
        watcher = asyncio.ensure_future(self._watch(receive, task))
        try:
            if self.opts.stream:
                await self._stream(send)
            else:
                await self._whole(send)
        except asyncio.CancelledError:
            if not self.client_gone:
                raise
            task.uncancel()     # the client left; Frontend's relay cancelled the request
        finally:
            watcher.cancel()

    async def _watch(self, receive, task) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self.finishing:
                    self.client_gone = True
                    task.cancel()
                return

    def _headers(self, content_type: str) -> list[tuple[bytes, bytes]]:
        return [(b"content-type", content_type.encode()), (b"x-request-id", self.request_id.encode()),
                (b"cache-control", b"no-cache")]

    async def _send_error(self, send, exc: BaseException) -> None:
        status, body, headers = _error_of(exc)
        self.finishing = True
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"),
            *((k.encode(), v.encode()) for k, v in headers.items())]})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    async def _whole(self, send) -> None:
        text, token_ids, logprobs, final = [], [], [], None
        try:
            async for out in self._events():
                if isinstance(out, TokensOut):
                    text.append(out.text)
                    token_ids.extend(out.token_ids)
                    logprobs.extend(out.logprobs)
                elif isinstance(out, FinalOut):
                    final = out
                else:
                    self.request_id = out.request_id
        except Exception as exc:  # noqa: BLE001 - every error becomes an OpenAI-shaped status
            await self._send_error(send, exc)
            return
        body = self.shape.whole("".join(text), token_ids, logprobs, final)
        self.finishing = True
        await send({"type": "http.response.start", "status": 200,
                    "headers": self._headers("application/json")})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})

    async def _stream(self, send) -> None:
        events = self._events()
        try:
            admitted = await events.__anext__()
        except Exception as exc:  # noqa: BLE001
            await self._send_error(send, exc)
            return
        assert isinstance(admitted, Admitted)
        self.request_id = admitted.request_id
        self.shape.start(admitted.request_class)
        await send({"type": "http.response.start", "status": 200,
                    "headers": self._headers("text/event-stream")})
        if self.opts.chat:
            await send({"type": "http.response.body", "body": self.shape.role_chunk(),
                        "more_body": True})
        try:
            async for out in events:
                if isinstance(out, TokensOut):
                    if out.text or (self.opts.logprobs and out.token_ids):
                        await send({"type": "http.response.body", "body": self.shape.chunk(out),
                                    "more_body": True})
                else:
                    # The final event is the generator's last: the loop ends with it, so the
                    # span closes here, in this task (not in a finalizer elsewhere).
                    self.finishing = True
                    await send({"type": "http.response.body",
                                "body": self.shape.finish_chunk(out) + b"data: [DONE]\n\n"})
        except Exception as exc:  # noqa: BLE001 - after the 200: an error event, as OpenAI sends
            self.finishing = True
            await send({"type": "http.response.body", "body": sse_error(exc)})


# ---------------------------------------------------------------------------------------------
# The Batch API, on the gateway's batch jobs

def file_key(file_id: str) -> str:
    return f"llmmesh:openai:file:{file_id}"


def batch_meta_key(job_id: str) -> str:
    return f"llmmesh:openai:batch:{job_id}"


def tenant_batches_key(tenant_id: str) -> str:
    return f"llmmesh:openai:batches:{tenant_id}"


def _file_object(file_id: str, meta: dict) -> dict:
    return {"id": file_id, "object": "file", "bytes": int(meta["bytes"]),
            "created_at": int(float(meta["created_at"])), "filename": meta["filename"],
            "purpose": meta["purpose"], "status": "processed", "status_details": None,
            "expires_at": int(float(meta["created_at"])) + int(meta.get("ttl_s", 0))}


class OpenAIFront:
    """The routes; every one authenticates with the same tenants file as gRPC."""

    def __init__(self, frontend: Frontend, tenants: TenantBook, models: dict[str, ServedModel],
                 default_model: str, batch_jobs: BatchJobs, healthy=None):
        self.frontend, self.tenants, self.models = frontend, tenants, models
        self.default_model, self.batch_jobs = default_model, batch_jobs
        self.redis = frontend.redis
        self.healthy = healthy
        self.ttl_s = batch_jobs.results_ttl_s

    # -- helpers --------------------------------------------------------------------------
    def _tenant(self, request: Request) -> Tenant:
        return self.tenants.authenticate((("authorization", request.headers.get("authorization", "")),))

    @staticmethod
    async def _json(request: Request):
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise InvalidArgument("body", f"larger than {MAX_BODY_BYTES} bytes")
        data = bytearray()
        async for piece in request.stream():
            data += piece
            if len(data) > MAX_BODY_BYTES:
                raise InvalidArgument("body", f"larger than {MAX_BODY_BYTES} bytes")
        try:
            return json.loads(data)
        except ValueError as exc:
            raise InvalidArgument("body", f"is not valid JSON ({exc})") from None

    # -- completions ----------------------------------------------------------------------
    async def _generate(self, request: Request, chat: bool):
        try:
            tenant = self._tenant(request)
            body = await self._json(request)
            valid, opts = parse(body, chat, self.models, self.default_model, request.headers)
            deadline = deadline_ns(request.headers)
        except Exception as exc:  # noqa: BLE001
            return _error_response(exc)
        return Generation(self.frontend, tenant, valid, opts, deadline)

    async def chat_completions(self, request: Request):
        return await self._generate(request, chat=True)

    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    async def list_models(self, request: Request):
        try:
            self._tenant(request)
        except MeshError as exc:
            return _error_response(exc)
        live = await live_states(self.frontend.redis)
        return JSONResponse({"object": "list", "data": [
            {"id": row.pop("name"), "object": "model", "created": 0, "owned_by": "llmmesh", **row}
            for row in describe(self.models, live)]})

    async def health(self, request: Request):
        ok = True if self.healthy is None else await self.healthy()
        return JSONResponse({"status": "serving" if ok else "not_serving"},
                            status_code=200 if ok else 503)

    # -- files ----------------------------------------------------------------------------
    async def create_file(self, request: Request):
        try:
            tenant = self._tenant(request)
            declared = request.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > MAX_FILE_BYTES + 65536:
                raise InvalidArgument("file", f"larger than {MAX_FILE_BYTES} bytes")
            async with request.form(max_files=1, max_fields=8) as form:
                purpose = form.get("purpose")
                upload = form.get("file")
                if purpose != "batch":
                    raise InvalidArgument("purpose", f"only \"batch\" is supported, got {purpose!r}")
                if upload is None or isinstance(upload, str):
                    raise InvalidArgument("file", "must be a file part of the multipart form")
                data = await upload.read(MAX_FILE_BYTES + 1)
                filename = upload.filename or "upload.jsonl"
            if len(data) > MAX_FILE_BYTES:
                raise InvalidArgument("file", f"larger than {MAX_FILE_BYTES} bytes")
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidArgument("file", "must be UTF-8 JSON lines") from None
            file_id = "file-" + uuid.uuid4().hex
            meta = await self._put_file(tenant, file_id, filename, purpose, text)
        except Exception as exc:  # noqa: BLE001
            return _error_response(exc)
        return JSONResponse(_file_object(file_id, meta))

    async def _put_file(self, tenant: Tenant, file_id: str, filename: str, purpose: str,
                        text: str) -> dict:
        meta = {"tenant_id": tenant.tenant_id, "filename": filename, "purpose": purpose,
                "bytes": len(text.encode()), "created_at": time.time(), "ttl_s": self.ttl_s}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(file_key(file_id), mapping={**meta, "content": text})
            pipe.expire(file_key(file_id), self.ttl_s)
            await pipe.execute()
        return meta

    async def _file(self, tenant: Tenant, file_id: str, content: bool = False) -> dict:
        fields = ["tenant_id", "filename", "purpose", "bytes", "created_at", "ttl_s"]
        if content:
            fields.append("content")
        values = await self.redis.hmget(file_key(file_id), fields)
        meta = dict(zip(fields, values))
        # Another tenant's file is reported exactly like a missing one.
        if meta["tenant_id"] != tenant.tenant_id:
            raise NotFound(f"file {file_id!r} not found")
        return meta

    async def get_file(self, request: Request):
        try:
            tenant = self._tenant(request)
            file_id = request.path_params["file_id"]
            meta = await self._file(tenant, file_id)
        except Exception as exc:  # noqa: BLE001
            return _error_response(exc)
        return JSONResponse(_file_object(file_id, meta))

    async def file_content(self, request: Request):
        try:
            tenant = self._tenant(request)
            meta = await self._file(tenant, request.path_params["file_id"], content=True)
        except Exception as exc:  # noqa: BLE001
            return _error_response(exc)
        return Response(meta["content"], media_type="application/jsonl")

    async def delete_file(self, request: Request):
        try:
            tenant = self._tenant(request)
            file_id = request.path_params["file_id"]
            await self._file(tenant, file_id)
            await self.redis.delete(file_key(file_id))
        except Exception as exc:  # noqa: BLE001
            return _error_response(exc)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    # -- batches --------------------------------------------------------------------------
    def _parse_batch_file(self, text: str, endpoint: str) -> tuple[list[ValidRequest], list]:
        """Every line checked as its request would be; the first bad one names its line."""
        chat = endpoint == "/v1/chat/completions"
        items, described, seen = [], [], set()
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    raise InvalidArgument("line", f"is not valid JSON ({exc})") from None
                if not isinstance(obj, dict):
                    raise InvalidArgument("line", "must be a JSON object")
                custom_id = obj.get("custom_id")
                if not isinstance(custom_id, str) or not custom_id:
                    raise InvalidArgument("custom_id", "must be a non-empty string")
                if custom_id in seen:
                    raise InvalidArgument("custom_id", f"{custom_id!r} appears twice in the file")
                seen.add(custom_id)
                if obj.get("method", "POST") != "POST":
                    raise InvalidArgument("method", "must be POST")
                if obj.get("url", endpoint) != endpoint:
                    raise InvalidArgument("url", f"must be the batch's endpoint {endpoint}")
                body = obj.get("body")
                if isinstance(body, dict) and body.get("stream"):
                    raise InvalidArgument("body.stream", "batch requests cannot stream")
                valid, _ = parse(body, chat, self.models, self.default_model)
            except InvalidArgument as exc:
                raise InvalidArgument("input_file_id", f"line {n}: {exc.message}") from exc
            items.append(valid)
            described.append([custom_id, valid.model.name, valid.sampling.get("stop") or []])
        if not items:
            raise InvalidArgument("input_file_id", "the file holds no requests")
        return items, described

    async def create_batch(self, request: Request):
        try:
            tenant = self._tenant(request)
            body = await self._json(request)
            if not isinstance(body, dict):
                raise InvalidArgument("body", "must be a JSON object")
            endpoint = body.get("endpoint")
            if endpoint not in BATCH_ENDPOINTS:
                raise InvalidArgument("endpoint", f"must be one of {', '.join(BATCH_ENDPOINTS)}, "
                                      f"got {endpoint!r}")
            if body.get("completion_window", "24h") != "24h":
                raise InvalidArgument("completion_window", "must be \"24h\"")
            metadata = body.get("metadata") or {}
            if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
                raise InvalidArgument("metadata", "at most 16 string keys with string values")
            file_id = body.get("input_file_id")
            if not isinstance(file_id, str) or not file_id:
                raise InvalidArgument("input_file_id", "must be a file id from POST /v1/files")
            meta = await self._file(tenant, file_id, content=True)
            # Tokenizing thousands of prompts: off the event loop, which relays live tokens.
            items, described = await asyncio.to_thread(self._parse_batch_file, meta["content"],
                                                       endpoint)
            try:
                job = await self.batch_jobs.submit(
                    tenant, items, metadata.get("description", f"openai batch of {file_id}"))
            except InvalidArgument as exc:
                raise InvalidArgument("input_file_id", exc.message) from exc
            job_id, now = job["job_id"], time.time()
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(batch_meta_key(job_id), mapping={
                    "endpoint": endpoint, "input_file_id": file_id, "metadata": json.dumps(metadata),
                    "items": json.dumps(described)})
                pipe.expire(batch_meta_key(job_id), self.ttl_s)
                pipe.zadd(tenant_batches_key(tenant.tenant_id), {job_id: now})
                pipe.zremrangebyscore(tenant_batches_key(tenant.tenant_id), 0, now - self.ttl_s)
                pipe.expire(tenant_batches_key(tenant.tenant_id), self.ttl_s)
                await pipe.execute()
            return JSONResponse(await self._batch_object(tenant, job))
        except Exception as exc:  # noqa: BLE001
            return _error_response(exc)

    async def _batch_object(self, tenant: Tenant, job: dict) -> dict:
        meta = await self.redis.hgetall(batch_meta_key(job["job_id"]))
        total, done = job["num_requests"], job["num_completed"] + job["num_failed"]
        created = int(job["created_unix_s"])
        status = {"running": "in_progress", "completed": "completed",
                  "cancelled": "cancelled" if done == total else "cancelling"}[job["status"]]
        if done == total and "output_file_id" not in meta:
            meta = await self._finalize(tenant, job, meta)
        ended_at = int(float(meta["ended_at"])) if "ended_at" in meta else None
        return {
            "id": job["job_id"], "object": "batch",
            "endpoint": meta.get("endpoint", "/v1/chat/completions"), "errors": None,
            "input_file_id": meta.get("input_file_id", ""), "completion_window": "24h",
            "status": status, "output_file_id": meta.get("output_file_id") or None,
            "error_file_id": meta.get("error_file_id") or None, "created_at": created,
            "in_progress_at": created, "expires_at": created + job["results_ttl_s"],
            "finalizing_at": None, "completed_at": ended_at if status == "completed" else None,
            "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": ended_at if status == "cancelled" else None,
            "request_counts": {"total": total, "completed": job["num_completed"],
                               "failed": job["num_failed"]},
            "metadata": json.loads(meta["metadata"]) if meta.get("metadata") else None,
            # The mesh's own view, as gRPC GetBatch shows it.
            "llmmesh": {"display_name": job["display_name"], "prompt_tokens": job["prompt_tokens"],
                        "completion_tokens": job["completion_tokens"]}}

    async def _finalize(self, tenant: Tenant, job: dict, meta: dict) -> dict:
        """Write the output and error files of a job whose requests all ended (once: the first
        caller's files win, a racing one's are dropped)."""
        job_id = job["job_id"]
        chat = meta.get("endpoint", "/v1/chat/completions") == "/v1/chat/completions"
        described = json.loads(meta["items"]) if meta.get("items") else []
        out, err = [], []
        async for r in self.batch_jobs.results(tenant, job_id):
            i = r["index"]
            custom_id, model_name, stop = (described[i] if i < len(described)
                                           else [f"request-{i}", self.default_model, []])
            line = {"id": f"batch_req_{r['request_id']}", "custom_id": custom_id}
            if r["error_code"]:
                status = _HTTP.get(grpc.StatusCode[r["error_code"]], (500, "server_error"))[0] \
                    if r["error_code"] in grpc.StatusCode.__members__ else 500
                line["response"] = {"status_code": status, "request_id": r["request_id"],
                                    "body": error_body("batch_request_error",
                                                       r["error_message"], code=r["error_code"].lower())}
                line["error"] = {"code": r["error_code"].lower(), "message": r["error_message"]}
                err.append((i, line))
                continue
            model = self.models.get(model_name) or self.models[self.default_model]
            stream = TextStream(model.tokenizer, stop)
            text = stream.push(r["token_ids"]) + stream.flush()
            shape = Shape(Options(chat=chat), model, r["request_id"])
            final = FinalOut(r["request_id"], RequestClass.BATCH, r["finish_reason"], r["usage"])
            line["response"] = {"status_code": 200, "request_id": r["request_id"],
                                "body": shape.whole(text, r["token_ids"], [], final)}
            line["error"] = None
            out.append((i, line))
        files = {}
        for name, lines in (("output_file_id", out), ("error_file_id", err)):
            if not lines:
                files[name] = ""
                continue
            file_id = f"file-{job_id}-{name.split('_')[0]}-{uuid.uuid4().hex[:8]}"
            text = "".join(json.dumps(line) + "\n" for _, line in sorted(lines, key=lambda x: x[0]))
            await self._put_file(tenant, file_id, f"{job_id}_{name.split('_')[0]}.jsonl",
                                 "batch_output", text)
            files[name] = file_id
        if await self.redis.hsetnx(batch_meta_key(job_id), "output_file_id", files["output_file_id"]):
            await self.redis.hset(batch_meta_key(job_id), mapping={
                "error_file_id": files["error_file_id"], "ended_at": time.time()})
            await self.redis.expire(batch_meta_key(job_id), self.ttl_s)
        else:
            await self.redis.delete(*(file_key(f) for f in files.values() if f))
        return await self.redis.hgetall(batch_meta_key(job_id))

    async def get_batch(self, request: Request):
        try:
            tenant = self._tenant(request)
            job = await self.batch_jobs.get(tenant, request.path_params["batch_id"])
            return JSONResponse(await self._batch_object(tenant, job))
        except Exception as exc:  # noqa: BLE001
            return _error_response(exc)

    async def cancel_batch(self, request: Request):
        try:
            tenant = self._tenant(request)
            job = await self.batch_jobs.cancel(tenant, request.path_params["batch_id"])
            return JSONResponse(await self._batch_object(tenant, job))
        except Exception as exc:  # noqa: BLE001
            return _error_response(exc)

    async def list_batches(self, request: Request):
        try:
            tenant = self._tenant(request)
            limit = request.query_params.get("limit", "20")
            if not limit.isdigit() or not 1 <= int(limit) <= 100:
                raise InvalidArgument("limit", "must be an integer in [1, 100]")
            after = request.query_params.get("after")
            ids = await self.redis.zrevrange(tenant_batches_key(tenant.tenant_id), 0, -1)
            if after in ids:
                ids = ids[ids.index(after) + 1:]
            data = []
            for job_id in ids:
                if len(data) > int(limit):
                    break
                try:
                    data.append(await self._batch_object(tenant, await self.batch_jobs.get(tenant, job_id)))
                except NotFound:
                    continue   # expired
            more = len(data) > int(limit)
            data = data[:int(limit)]
        except Exception as exc:  # noqa: BLE001
            return _error_response(exc)
        return JSONResponse({"object": "list", "data": data, "has_more": more,
                             "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None})

    # -- the app --------------------------------------------------------------------------
    def app(self) -> Starlette:
        async def not_found(request: Request, exc):
            return JSONResponse(error_body("not_found_error",
                                           f"no route {request.method} {request.url.path}"),
                                status_code=404)

        async def not_allowed(request: Request, exc):
            return JSONResponse(error_body("invalid_request_error",
                                           f"{request.method} is not allowed on {request.url.path}"),
                                status_code=405)
        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/files", self.create_file, methods=["POST"]),
            Route("/v1/files/{file_id}", self.get_file, methods=["GET"]),
            Route("/v1/files/{file_id}", self.delete_file, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", self.file_content, methods=["GET"]),
            Route("/v1/batches", self.create_batch, methods=["POST"]),
            Route("/v1/batches", self.list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.get_batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel_batch, methods=["POST"]),
        ]
        return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed})


# ---------------------------------------------------------------------------------------------
# Serving it in the gateway's event loop

class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway's bootstrap owns SIGTERM/SIGINT."""

    def capture_signals(self):
        return contextlib.nullcontext()


class HttpServer:
    def __init__(self, app, listen: str, tls: tuple[str, str] | None = None):
        host, _, port = listen.rpartition(":")
        self.config = uvicorn.Config(
            app, host=host.strip("[]"), port=int(port), loop="none", http="httptools",
            lifespan="off", access_log=False, log_level="warning", ws="none",
            timeout_keep_alive=30, timeout_graceful_shutdown=5, server_header=False,
            ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None)
        self.server = _Server(self.config)
        self.task: asyncio.Task | None = None

    async def start(self) -> str:
        self.task = asyncio.ensure_future(self.server.serve())
        while not self.server.started:
            if self.task.done():
                self.task.result()   # raises why it could not start
                raise RuntimeError(f"HTTP front could not listen on {self.config.host}:{self.config.port}")
            await asyncio.sleep(0.01)
        sock = self.server.servers[0].sockets[0].getsockname()
        return f"{sock[0]}:{sock[1]}"

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task

    @property
    def scheme(self) -> str:
        return "https" if self.config.ssl_certfile else "http"

