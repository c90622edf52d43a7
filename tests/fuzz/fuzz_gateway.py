"""Atheris (coverage-guided) over the gateway's decode and validation: the bytes of a gRPC
GenerateRequest, the JSON body of an OpenAI-style call, or a request built field by field from
the fuzzer's bytes, through the same functions the gateway runs (GenerateRequest.FromString,
gateway.validation.validate, gateway.openai_http.parse) with the real model's tokenizer.

The only outcomes allowed are a validated request or a typed refusal (llmmesh.errors.MeshError,
which the gateway answers with its status, naming the field); for wire bytes also a protobuf
DecodeError, for a body also JSON that does not parse. Anything else is a crash: atheris stops
and prints the input.

    python -m tests.fuzz.fuzz_gateway -max_total_time=60 [corpus_dir]   (`make fuzz`: longer)
"""
from __future__ import annotations

import json
import sys

import atheris

with atheris.instrument_imports(include=["gateway", "llmmesh.tokenizer", "llmmesh.errors"]):
    from gateway.openai_http import parse
    from gateway.validation import ServedModel, validate
    from llmmesh.errors import MeshError
    from llmmesh.models import resolve_model
    from llmmesh.tokenizer import Tokenizer
    from llmmesh.v1 import common_pb2, gateway_pb2

from google.protobuf.message import DecodeError

MODEL = "smollm2-135m-instruct"
MODELS = {MODEL: ServedModel(MODEL, 8192, "int4", Tokenizer.from_gguf(resolve_model().gguf_path))}
_FLOATS = [float("nan"), float("inf"), -float("inf"), 0.0, 1.0, 2.5, -1.0, 1e308]


def _float(fdp: atheris.FuzzedDataProvider) -> float:
    return fdp.PickValueInList(_FLOATS) if fdp.ConsumeBool() else fdp.ConsumeRegularFloat()


def _built(fdp: atheris.FuzzedDataProvider) -> gateway_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        max_tokens=fdp.ConsumeIntInRange(-2**31, 2**31 - 1), temperature=_float(fdp),
        top_p=_float(fdp), top_k=fdp.ConsumeIntInRange(-2**31, 2**31 - 1),
        stop=[fdp.ConsumeUnicodeNoSurrogates(8) for _ in range(fdp.ConsumeIntInRange(0, 8))],
        logprobs=fdp.ConsumeBool())
    req = gateway_pb2.GenerateRequest(
        sampling=sampling, model=fdp.PickValueInList([MODEL, "", "gpt-9"]),
        request_class=fdp.ConsumeIntInRange(-3, 6),
        request_id=fdp.ConsumeUnicodeNoSurrogates(40) if fdp.ConsumeBool() else "")
    if fdp.ConsumeBool():
        req.prompt = fdp.ConsumeUnicodeNoSurrogates(512)
    else:
        for _ in range(fdp.ConsumeIntInRange(0, 3)):
            req.messages.add(role=fdp.PickValueInList(["user", "system", "assistant", "tool", ""]),
                             content=fdp.ConsumeUnicodeNoSurrogates(256))
    return req


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    mode = fdp.ConsumeIntInRange(0, 2)
    try:
        if mode == 0:      # the wire: what grpc hands the servicer
            try:
                req = gateway_pb2.GenerateRequest.FromString(fdp.ConsumeBytes(fdp.remaining_bytes()))
            except DecodeError:
                return
            validate(req, MODELS, MODEL)
        elif mode == 1:    # the OpenAI-compatible HTTP body
            chat = fdp.ConsumeBool()
            try:
                body = json.loads(fdp.ConsumeBytes(fdp.remaining_bytes()))
            except (ValueError, RecursionError):
                return
            parse(body, chat, MODELS, MODEL)
        else:
            validate(_built(fdp), MODELS, MODEL)
    except MeshError:
        return


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
