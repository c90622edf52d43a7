"""Field-by-field checks of a GenerateRequest; every refusal names the field it is about."""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from llmmesh import vocab
from llmmesh.errors import InvalidArgument, NotFound
from llmmesh.v1 import common_pb2, gateway_pb2
from llmmesh.vocab import RequestClass

DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 4
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    context_length: int
    quantization: str
    tokenizer: object  # llmmesh.tokenizer.Tokenizer
    allowed_tenants: tuple[str, ...] = ()   # the catalog's; empty: every tenant
    description: str = ""


@dataclass(frozen=True, slots=True)
class ValidRequest:
    request_id: str
    model: ServedModel
    prompt_token_ids: list[int]
    sampling: dict
    requested_class: str
    operation: str = "text_completion"   # gen_ai.operation.name: "chat" for messages


def _check_text_input(req: gateway_pb2.GenerateRequest) -> None:
    if req.prompt and req.messages:
        raise InvalidArgument("prompt", "set either prompt or messages, not both")
    if not req.prompt and not req.messages:
        raise InvalidArgument("prompt", "must not be empty (or set messages)")
    for i, msg in enumerate(req.messages):
        if msg.role not in _ROLES:
            raise InvalidArgument(f"messages[{i}].role", f"must be one of {', '.join(_ROLES)}")
        if not msg.content:
            raise InvalidArgument(f"messages[{i}].content", "must not be empty")


# No token of these tokenizers spans more characters than this on average over a prompt
# (English runs ~4): text longer than context × this cannot fit, so it is refused before it is
# tokenized — tokenizing holds the gateway's event loop (and the GIL) for its whole length.
MAX_CHARS_PER_TOKEN = 16


def _check_text_size(req: gateway_pb2.GenerateRequest, context: int) -> None:
    limit = context * MAX_CHARS_PER_TOKEN
    size = len(req.prompt) + sum(len(m.content) for m in req.messages)
    if size > limit:
        field = "prompt" if req.prompt else "messages"
        raise InvalidArgument(field, f"{size} characters cannot fit the model's context of "
                              f"{context} tokens (at most {limit} characters); shorten it")


def _sampling(s: common_pb2.SamplingParams, num_prompt: int, context: int) -> dict:
    room = context - num_prompt
    if room < 1:
        raise InvalidArgument("prompt", f"{num_prompt} tokens leave no room in the model's "
                              f"context of {context} tokens")
    if s.HasField("max_tokens"):
        if s.max_tokens <= 0:
            raise InvalidArgument("sampling.max_tokens", f"must be >= 1, got {s.max_tokens}")
        if s.max_tokens > room:
            raise InvalidArgument("sampling.max_tokens", f"{s.max_tokens} + {num_prompt} prompt "
                                  f"tokens exceeds the model's context of {context} tokens")
    if not 0.0 <= s.temperature <= 2.0:
        raise InvalidArgument("sampling.temperature", f"must be in [0, 2], got {s.temperature}")
    if not 0.0 <= s.top_p <= 1.0:
        raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise InvalidArgument("sampling.top_k", f"must be >= 0, got {s.top_k}")
    if len(s.stop) > MAX_STOP_STRINGS or any(not x for x in s.stop):
        raise InvalidArgument("sampling.stop", f"at most {MAX_STOP_STRINGS} non-empty strings")
    return {
        "max_tokens": s.max_tokens if s.HasField("max_tokens") else min(DEFAULT_MAX_TOKENS, room),
        "temperature": s.temperature, "top_p": s.top_p or 1.0, "top_k": s.top_k,
        "seed": s.seed if s.HasField("seed") else None, "stop": list(s.stop),
        "logprobs": s.logprobs,
    }


def validate(req: gateway_pb2.GenerateRequest, models: dict[str, ServedModel],
             default_model: str) -> ValidRequest:
    """Check every field and tokenize; raises InvalidArgument / NotFound."""
    try:
        requested_class = RequestClass.from_proto(req.request_class)
    except ValueError:
        raise InvalidArgument("request_class", f"unknown value {req.request_class}") from None
    if req.request_id and not _REQUEST_ID.match(req.request_id):
        raise InvalidArgument("request_id", "1-128 characters of [A-Za-z0-9._:-]")
    name = req.model or default_model
    model = models.get(name)
    if model is None:
        raise NotFound(f"model {name!r} not found; available: {', '.join(sorted(models))}")
    _check_text_input(req)
    _check_text_size(req, model.context_length)
    tok = model.tokenizer
    if req.messages:
        text = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in req.messages])
    else:
        text = req.prompt
    token_ids = tok.encode(text)
    if not token_ids:
        raise InvalidArgument("prompt", "tokenizes to zero tokens")
    sampling = _sampling(req.sampling, len(token_ids), model.context_length)
    return ValidRequest(request_id=req.request_id or uuid.uuid4().hex, model=model,
                        prompt_token_ids=token_ids, sampling=sampling,
                        requested_class=requested_class,
                        operation=vocab.CHAT if req.messages else vocab.TEXT_COMPLETION)
