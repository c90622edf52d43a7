"""The HTTP front's translation: OpenAI bodies into the gRPC front's requests (one validation for
both doors, errors renamed to the body's own field names), the error table, and the SSE frames
(built by hand for speed, so each is parsed back here)."""
from __future__ import annotations

import json

import pytest

from gateway.frontend import FinalOut, TokensOut
from gateway.openai_http import Options, Shape, _error_of, deadline_ns, parse, to_request
from gateway.validation import ServedModel
from llmmesh.errors import DeadlineExceeded, InvalidArgument, NotFound, ResourceExhausted, Unauthenticated
from llmmesh.models import resolve_model
from llmmesh.tokenizer import Tokenizer
from llmmesh.v1 import common_pb2

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def models():
    tok = Tokenizer.from_gguf(resolve_model().gguf_path)
    return {MODEL: ServedModel(MODEL, 8192, "int4", tok)}


def _chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], **kw}


def _refusal(models, body, chat=True, headers=None) -> tuple[str, str]:
    with pytest.raises(InvalidArgument) as info:
        parse(body, chat, models, MODEL, headers)
    status, err, _ = _error_of(info.value)
    assert status == 400 and err["error"]["type"] == "invalid_request_error"
    return err["error"]["param"], err["error"]["message"]


def test_a_chat_body_becomes_the_grpc_request(models):
    valid, opts = parse(_chat(max_completion_tokens=7, temperature=0.2, top_p=0.9, seed=3,
                              stop="END", logprobs=True, stream=True,
                              stream_options={"include_usage": True}, user="u-1"),
                        True, models, MODEL)
    assert valid.sampling["max_tokens"] == 7 and valid.sampling["stop"] == ["END"]
    assert valid.sampling["seed"] == 3 and valid.sampling["logprobs"] is True
    assert abs(valid.sampling["temperature"] - 0.2) < 1e-6 and abs(valid.sampling["top_p"] - 0.9) < 1e-6
    assert (opts.stream, opts.include_usage, opts.logprobs, opts.user) == (True, True, True, "u-1")
    # The chat template was applied: the prompt holds the user's text and more.
    text = models[MODEL].tokenizer.decode(valid.prompt_token_ids)
    assert "Hello" in text and len(valid.prompt_token_ids) > 3


def test_openai_defaults_differ_from_grpc_ones_where_openai_says_so(models):
    valid, opts = parse(_chat(), True, models, MODEL)
    assert valid.sampling["temperature"] == 1.0      # OpenAI's default; gRPC's is greedy
    assert valid.requested_class == "interactive" and not opts.stream


def test_content_parts_and_developer_role(models):
    body = {"model": MODEL, "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]}
    valid, _ = parse(body, True, models, MODEL)
    text = models[MODEL].tokenizer.decode(valid.prompt_token_ids)
    assert "Be brief." in text and "Hi\nthere" in text
    assert _refusal(models, {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})[0] == \
        "messages[0].content[0].type"
    assert _refusal(models, {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]})[0] == \
        "messages[0].role"


@pytest.mark.parametrize("body,param", [
    (_chat(max_tokens=0), "max_tokens"),
    (_chat(max_completion_tokens=0), "max_completion_tokens"),
    (_chat(max_tokens=10**12), "max_tokens"),
    (_chat(max_tokens=9000), "max_tokens"),         # beyond the context: the gRPC check, renamed
    (_chat(temperature=5), "temperature"),
    (_chat(temperature="hot"), "temperature"),
    (_chat(top_p=1.5), "top_p"),
    (_chat(n=2), "n"),
    (_chat(stop=[1, 2]), "stop"),
    (_chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (_chat(seed=-1), "seed"),
    (_chat(top_logprobs=3, logprobs=True), "top_logprobs"),
    (_chat(presence_penalty=0.5), "presence_penalty"),
    (_chat(tools=[{"type": "function"}]), "tools"),
    (_chat(response_format={"type": "json_object"}), "response_format"),
    (_chat(service_tier="gold"), "service_tier"),
    (_chat(stream_options={"include_usage": True}), "stream_options"),
    (_chat(stream="yes"), "stream"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ([1, 2], "body"),
])
def test_each_bad_chat_field_is_named(models, body, param):
    assert _refusal(models, body)[0] == param


def test_completions_prompt_forms(models):
    valid, opts = parse({"model": MODEL, "prompt": ["The sky is"], "max_tokens": 4, "logprobs": 0},
                        False, models, MODEL)
    assert valid.sampling["max_tokens"] == 4 and opts.logprobs
    assert _refusal(models, {"model": MODEL, "prompt": ["a", "b"]}, chat=False)[0] == "prompt"
    assert _refusal(models, {"model": MODEL, "prompt": 12}, chat=False)[0] == "prompt"
    assert _refusal(models, {"model": MODEL, "prompt": ""}, chat=False)[0] == "prompt"
    assert _refusal(models, {"model": MODEL, "prompt": "x", "logprobs": 2}, chat=False)[0] == "logprobs"
    assert _refusal(models, {"model": MODEL, "prompt": "x", "echo": True}, chat=False)[0] == "echo"


def test_class_from_service_tier_and_header(models):
    assert parse(_chat(service_tier="flex"), True, models, MODEL)[0].requested_class == "batch"
    assert parse(_chat(service_tier="priority"), True, models, MODEL)[0].requested_class == "interactive"
    assert parse(_chat(), True, models, MODEL, {"x-llmmesh-class": "batch"})[0].requested_class == "batch"
    assert _refusal(models, _chat(), headers={"x-llmmesh-class": "urgent"})[0] == "x-llmmesh-class"
    assert parse(_chat(), True, models, MODEL, {"x-client-request-id": "abc-1"})[0].request_id == "abc-1"
    assert _refusal(models, _chat(), headers={"x-client-request-id": "no spaces"})[0] == "x-client-request-id"


def test_unknown_model_is_404_listing_what_exists(models):
    with pytest.raises(NotFound) as info:
        parse(_chat(model="gpt-17"), True, models, MODEL)
    status, body, _ = _error_of(info.value)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert MODEL in body["error"]["message"]


def test_error_table():
    status, body, headers = _error_of(ResourceExhausted("tenant acme: requests per minute reached", 2.2))
    assert status == 429 and headers == {"retry-after": "3", "retry-after-ms": "2200"}
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "rate_limit_exceeded"
    status, body, _ = _error_of(ResourceExhausted("tenant acme: token budget reached", 60))
    assert body["error"]["code"] == "insufficient_quota"
    assert _error_of(Unauthenticated("API key not recognised"))[0] == 401
    assert _error_of(DeadlineExceeded("deadline passed"))[0] == 504
    status, body, _ = _error_of(RuntimeError("secret detail"))
    assert status == 500 and "secret" not in json.dumps(body)


def test_timeout_header():
    assert deadline_ns({}) == 0
    assert deadline_ns({"x-request-timeout": "2.5"}) > 0
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(InvalidArgument) as info:
            deadline_ns({"x-request-timeout": bad})
        assert info.value.field == "x-request-timeout"


def _frames(data: bytes) -> list:
    out = []
    for frame in data.decode().split("\n\n"):
        if frame:
            assert frame.startswith("data: ")
            payload = frame[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


@pytest.mark.parametrize("chat", [True, False])
def test_sse_frames_are_json_in_openais_chunk_shape(models, chat):
    opts = Options(chat=chat, stream=True, include_usage=True, logprobs=True)
    shape = Shape(opts, models[MODEL], "rid-1")
    shape.start("batch")
    tok = models[MODEL].tokenizer
    ids = tok.encode(' "quoted" \\ text\n')
    frames = []
    if chat:
        frames += _frames(shape.role_chunk())
    frames += _frames(shape.chunk(TokensOut(0, ids, tok.decode(ids), [-0.5] * len(ids))))
    usage = {"prompt_tokens": 5, "cached_prompt_tokens": 2, "completion_tokens": len(ids)}
    frames += _frames(shape.finish_chunk(FinalOut("rid-1", "batch", "length", usage)))
    for f in frames:
        assert f["id"] == ("chatcmpl-rid-1" if chat else "cmpl-rid-1")
        assert f["object"] == ("chat.completion.chunk" if chat else "text_completion")
        assert f["model"] == MODEL and f["service_tier"] == "flex"
    content = frames[-3]["choices"][0]
    text = content["delta"]["content"] if chat else content["text"]
    assert text == tok.decode(ids)
    lp = content["logprobs"]
    assert len(lp["content"] if chat else lp["tokens"]) == len(ids)
    assert frames[-2]["choices"][0]["finish_reason"] == "length"
    assert frames[-1]["choices"] == [] and frames[-1]["usage"] == {
        "prompt_tokens": 5, "completion_tokens": len(ids), "total_tokens": 5 + len(ids),
        "prompt_tokens_details": {"cached_tokens": 2}}


def test_request_class_values_are_the_protos():
    req, _ = to_request(_chat(service_tier="flex"), True)
    assert req.request_class == common_pb2.REQUEST_CLASS_BATCH
