"""Hypothesis against the real gateway (a mesh with no worker, so nothing admitted runs): any
request — NaN and infinite floats, huge or negative ints, empty or oversize prompts, thousands
of stop strings, lone surrogates, unknown models and roles — gets a precise status, never
UNKNOWN or INTERNAL, every INVALID_ARGUMENT names its field first, and the gateway stays up.
LLMMESH_FUZZ_EXAMPLES sets the count (`make test`: 300; the issue's full run: 10,000)."""
from __future__ import annotations

import asyncio
import os
import re
import statistics
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmmesh.launcher import Mesh
from llmmesh.v1 import common_pb2, gateway_pb2
from tests.e2e.meshkit import DEMO_KEYS, auth

pytestmark = [pytest.mark.e2e, pytest.mark.model]
EXAMPLES = int(os.environ.get("LLMMESH_FUZZ_EXAMPLES", "300"))
EXPECTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.ALREADY_EXISTS}
FIELD = re.compile(r"^(request|prompt|messages(\[\d+\]\.(role|content))?|sampling\.\w+|request_class|"
                   r"request_id|model)\b")

# Stands in for bytes that are not UTF-8 (Python's protobuf refuses to encode them): replaced on
# the wire by as many 0xff bytes, so the length prefixes still hold.
BAD_UTF8 = "<<not-utf-8>>"
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 2.0]))
ints = st.one_of(st.integers(-2**31, 2**31 - 1), st.sampled_from([0, 1, 8, 4096, 10**6]))
texts = st.one_of(st.text(max_size=200), st.just(""), st.just("x" * 100_000),
                  st.just(BAD_UTF8), st.just("Hello?"))


@st.composite
def requests(draw) -> gateway_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        max_tokens=draw(ints), temperature=draw(floats), top_p=draw(floats), top_k=draw(ints),
        stop=draw(st.one_of(st.lists(st.text(max_size=8), max_size=5), st.just(["s"] * 3000))))
    req = gateway_pb2.GenerateRequest(
        sampling=sampling, model=draw(st.sampled_from(["", "smollm2-135m-instruct", "gpt-9", "x" * 500])),
        request_class=draw(st.integers(0, 5)),
        request_id=draw(st.one_of(st.just(""), st.text(max_size=200))))
    if draw(st.booleans()):
        req.prompt = draw(texts)
    else:
        for _ in range(draw(st.integers(0, 3))):
            req.messages.add(role=draw(st.sampled_from(["user", "system", "assistant", "root", ""])),
                             content=draw(texts))
    return req


@pytest.fixture(scope="module")
def fuzz_mesh(tmp_path_factory):
    m = Mesh(var_dir=str(tmp_path_factory.mktemp("fuzz")))
    try:
        asyncio.run(m.up(num_workers=0, timeout_s=120))
        yield m
    finally:
        m.down()


def test_any_request_gets_a_precise_status(fuzz_mesh):
    channel = grpc.insecure_channel(fuzz_mesh.procs["gateway"].address)
    generate = channel.unary_stream("/llmmesh.v1.GatewayService/Generate")   # raw bytes out
    seen: dict[str, int] = {}
    refusal_s: list[float] = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(requests())
    def one(req):
        wire = req.SerializeToString().replace(BAD_UTF8.encode(), b"\xff" * len(BAD_UTF8))
        started = time.perf_counter()
        try:
            # A request that passes validation waits for a worker that never comes.
            list(generate(wire, metadata=auth(DEMO_KEYS["acme"]), timeout=0.3))
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
        seen[code.name] = seen.get(code.name, 0) + 1
        assert code in EXPECTED, (code, details, req)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            refusal_s.append(time.perf_counter() - started)
            assert FIELD.match(details), details
    try:
        one()
    finally:
        channel.close()
    p99 = statistics.quantiles(refusal_s, n=100)[98] * 1000 if len(refusal_s) > 100 else float("nan")
    print(f"\n  {EXAMPLES} fuzzed requests: {dict(sorted(seen.items()))}; "
          f"refusal p99 {p99:.1f} ms; gateway alive: {fuzz_mesh.procs['gateway'].alive()}")
    assert fuzz_mesh.procs["gateway"].alive()
    assert seen.get("INVALID_ARGUMENT", 0) > EXAMPLES // 4   # the strategy reaches validation


def test_a_prompt_that_is_not_utf8_is_invalid_argument_not_unknown(fuzz_mesh):
    req = gateway_pb2.GenerateRequest(prompt=BAD_UTF8, sampling=common_pb2.SamplingParams(max_tokens=2))
    wire = req.SerializeToString().replace(BAD_UTF8.encode(), b"\xff" * len(BAD_UTF8))
    with grpc.insecure_channel(fuzz_mesh.procs["gateway"].address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(channel.unary_stream("/llmmesh.v1.GatewayService/Generate")(
                wire, metadata=auth(DEMO_KEYS["acme"]), timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("request: cannot be parsed (String field had bad UTF-8)")
