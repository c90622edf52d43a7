"""The whole mesh as real processes: redis-server, costd, a worker on the real model, router, gateway."""
from __future__ import annotations

import sqlite3
import time

import grpc
import pytest
import redis

from llmmesh import mtls, queue
from llmmesh.apikeys import DEMO_ADMIN_KEY
from tests.e2e.meshkit import wait_until
from llmmesh.identity import Role
from llmmesh.v1 import common_pb2, cost_pb2, cost_pb2_grpc, gateway_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.model]
KEYS = {"acme": "llmmesh-demo-acme", "globex": "llmmesh-demo-globex"}


def _auth(tenant: str):
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


def _chat(text: str, max_tokens: int = 30, cls=common_pb2.REQUEST_CLASS_INTERACTIVE):
    req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
                                      request_class=cls)
    req.messages.add(role="user", content=text)
    return req


def _stream(stub, req, tenant):
    chunks, arrivals, final = [], [], None
    for msg in stub.Generate(req, metadata=_auth(tenant), timeout=120):
        if msg.HasField("chunk"):
            chunks.append(msg.chunk)
            arrivals.append(time.monotonic())
        else:
            final = msg.final
    return chunks, arrivals, final


def test_two_tenants_two_classes_billed_as_told(mesh, gateway):
    since = time.time()  # the mesh is shared: bill only this test's requests
    chunks, arrivals, final = _stream(gateway, _chat("What is the capital of Japan?"), "acme")
    text = "".join(c.text for c in chunks)
    assert "Tokyo" in text
    assert final.request_class == common_pb2.REQUEST_CLASS_INTERACTIVE
    # Streamed as generated: tokens arrive in several messages spread over time, numbered densely.
    token_ids = [t for c in chunks for t in c.token_ids]
    assert len(token_ids) == final.usage.completion_tokens
    assert [c.index for c in chunks if c.token_ids] == \
        [sum(len(c.token_ids) for c in chunks[:i] if c.token_ids) for i, c in enumerate(chunks) if c.token_ids]
    assert len(set(round(a, 3) for a in arrivals)) >= 3
    # Spread over the decode itself (not buffered and sent at the end), whatever its speed.
    assert arrivals[-1] - arrivals[0] >= 0.5 * final.usage.decode_device_seconds > 0

    batch = _chat("Name one color of the rainbow.", max_tokens=12, cls=common_pb2.REQUEST_CLASS_BATCH)
    done = gateway.Complete(gateway_pb2.CompleteRequest(request=batch), metadata=_auth("globex"), timeout=120)
    assert done.text.strip()
    assert done.final.request_class == common_pb2.REQUEST_CLASS_BATCH
    assert len(done.token_ids) == done.final.usage.completion_tokens <= 12

    told = {"acme": final.usage, "globex": done.final.usage}
    with mtls.channel(mesh.procs["costd"].address, mesh.identity(), Role.COSTD) as channel:
        costd = cost_pb2_grpc.CostServiceStub(channel)
        deadline = time.monotonic() + 20
        while True:
            # Each tenant's own key reads its own usage (the admin key would read both).
            got = {t: costd.GetUsage(cost_pb2.GetUsageRequest(tenant_id=t, start_unix_s=since),
                                     metadata=_auth(t))
                   for t in told}
            if all(g.requests == 1 for g in got.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for tenant, usage in told.items():
            assert got[tenant].requests == 1
            assert got[tenant].prompt_tokens == usage.prompt_tokens > 0
            assert got[tenant].completion_tokens == usage.completion_tokens > 0
            assert got[tenant].decode_device_seconds > 0
        nobody = costd.GetUsage(cost_pb2.GetUsageRequest(tenant_id="nobody"),
                                metadata=(("authorization", f"Bearer {DEMO_ADMIN_KEY}"),))
        assert nobody.requests == 0 and nobody.completion_tokens == 0

    # Every entry was acknowledged once its request ended.
    r = redis.Redis.from_url(mesh.redis_url)
    for cls in queue.CLASSES:
        assert r.xpending(queue.queue_stream(cls), queue.ROUTER_GROUP)["pending"] == 0


def test_batch_tokens_come_in_chunks_interactive_ones_one_by_one(gateway):
    """Batch streams come in chunks (fewer result-stream events for worker, Redis and gateway),
    still numbered densely; interactive streams get every token as it is made."""
    sizes = {}
    for cls in (common_pb2.REQUEST_CLASS_BATCH, common_pb2.REQUEST_CLASS_INTERACTIVE):
        req = _chat("Write a long story about a cat who learns to fly.", max_tokens=48,
                    cls=cls)
        chunks, _, final = _stream(gateway, req, "acme")
        with_ids = [c for c in chunks if c.token_ids]
        assert sum(len(c.token_ids) for c in with_ids) == final.usage.completion_tokens >= 24
        assert [c.index for c in with_ids] == [
            sum(len(c.token_ids) for c in with_ids[:i]) for i in range(len(with_ids))]
        sizes[cls] = [len(c.token_ids) for c in with_ids]
    assert max(sizes[common_pb2.REQUEST_CLASS_BATCH]) <= 16
    assert len(sizes[common_pb2.REQUEST_CLASS_BATCH]) < sum(sizes[common_pb2.REQUEST_CLASS_BATCH]) / 2
    assert set(sizes[common_pb2.REQUEST_CLASS_INTERACTIVE]) == {1}


def _code(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


def test_bad_input_gets_a_precise_status_and_the_gateway_keeps_serving(gateway):
    ok = _chat("Say hi.", max_tokens=2)
    code, _ = _code(lambda: gateway.Complete(gateway_pb2.CompleteRequest(request=ok), timeout=30))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    code, _ = _code(lambda: gateway.Complete(gateway_pb2.CompleteRequest(request=ok), timeout=30,
                                             metadata=(("authorization", "Bearer wrong"),)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    unknown = _chat("hi", 2)
    unknown.model = "gpt-17"
    code, details = _code(lambda: gateway.Complete(gateway_pb2.CompleteRequest(request=unknown),
                                                   metadata=_auth("acme"), timeout=30))
    assert code == grpc.StatusCode.NOT_FOUND and "gpt-17" in details
    for bad_max in (0, -3, 10**6):
        req = _chat("hi", bad_max)
        code, details = _code(lambda: gateway.Complete(gateway_pb2.CompleteRequest(request=req),
                                                       metadata=_auth("acme"), timeout=30))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "sampling.max_tokens" in details
    empty = gateway_pb2.GenerateRequest(prompt="", sampling=common_pb2.SamplingParams(max_tokens=2))
    code, details = _code(lambda: list(gateway.Generate(empty, metadata=_auth("acme"), timeout=30)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in details
    # Still serving after every refusal.
    done = gateway.Complete(gateway_pb2.CompleteRequest(request=ok), metadata=_auth("acme"), timeout=60)
    assert done.final.usage.completion_tokens >= 1


def test_one_trace_per_request_across_gateway_router_worker(mesh, gateway, span_capture):
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as genai
    from opentelemetry.semconv.attributes import server_attributes
    final = _stream(gateway, _chat("Say one word.", max_tokens=3), "acme")[2]
    rid = final.request_id
    model = "smollm2-135m-instruct"
    # GenAI conventions: `{gen_ai.operation.name} {gen_ai.request.model}`; chat, as it was one.
    chat_name = f"{genai.GenAiOperationNameValues.CHAT.value} {model}"
    wanted = {"llmmesh-gateway": chat_name, "llmmesh-router": "router dispatch",
              "llmmesh-worker": chat_name}

    def three_spans():
        spans = {s["service"]: s for s in span_capture.for_request(rid)}
        return spans if set(spans) >= set(wanted) else None
    deadline = time.monotonic() + 15
    while not (by_service := three_spans()):
        assert time.monotonic() < deadline, span_capture.for_request(rid)
        time.sleep(0.1)
    spans = [by_service[s] for s in wanted]
    assert {s: by_service[s]["name"] for s in wanted} == wanted
    assert len({s["trace_id"] for s in spans}) == 1  # one trace, carried through Redis and gRPC
    gw, rt, wk = spans
    assert rt["parent_span_id"] == gw["span_id"] and wk["parent_span_id"] == rt["span_id"]
    for span in (gw, rt, wk):
        a = span["attributes"]
        assert a[genai.GEN_AI_OPERATION_NAME] == genai.GenAiOperationNameValues.CHAT.value
        assert a[genai.GEN_AI_PROVIDER_NAME] == "llmmesh"
        assert a[genai.GEN_AI_REQUEST_MODEL] == model
        assert a["llmmesh.tenant.id"] == "acme"
        assert a[genai.GEN_AI_USAGE_INPUT_TOKENS] == final.usage.prompt_tokens
        assert a[genai.GEN_AI_USAGE_OUTPUT_TOKENS] == final.usage.completion_tokens
    g = gw["attributes"]
    assert g[genai.GEN_AI_REQUEST_MAX_TOKENS] == 3 and g[genai.GEN_AI_REQUEST_TEMPERATURE] == 0.0
    assert g[genai.GEN_AI_RESPONSE_ID] == rt["attributes"]["llmmesh.request.id"]
    assert g[genai.GEN_AI_RESPONSE_MODEL] == model
    assert g[genai.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"]
    assert g[server_attributes.SERVER_ADDRESS] == "127.0.0.1"
    assert g[server_attributes.SERVER_PORT] == int(mesh.procs["gateway"].address.rsplit(":", 1)[1])
    assert "error.type" not in g
    # None of them is the bill: that is the router's record in Redis's billing stream, shipped
    # to costd alone (llmmesh.billing), and in the ledger once under the mesh's request id.
    assert all("llmmesh.usage.final" not in s["attributes"] for s in (gw, rt, wk))
    mesh_id = rt["attributes"]["llmmesh.request.id"]
    assert mesh_id.startswith(f"acme/{rid}/")

    def ledger():
        conn = sqlite3.connect(f"{mesh.var_dir}/ledger.sqlite")
        try:
            return conn.execute("SELECT tenant_id, prompt_tokens, completion_tokens FROM "
                                "usage_records WHERE request_id = ?", (mesh_id,)).fetchall()
        finally:
            conn.close()
    rows = wait_until(ledger, 15, what="the bill in the ledger")
    assert rows == [("acme", final.usage.prompt_tokens, final.usage.completion_tokens)]


def test_a_failed_request_names_its_error_type_on_the_spans(gateway, span_capture):
    req = _chat("Write a very long story about the sea.", max_tokens=400)
    req.request_id = f"deadline-{time.monotonic_ns()}"
    with pytest.raises(grpc.RpcError) as info:
        list(gateway.Generate(req, metadata=_auth("acme"), timeout=0.3))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def gateway_span():
        spans = [s for s in span_capture.for_request(req.request_id) if s["service"] == "llmmesh-gateway"]
        return spans[0] if spans else None
    span = wait_until(gateway_span, 15, what="the failed request's gateway span")
    assert span["attributes"]["error.type"] in ("DEADLINE_EXCEEDED", "CANCELLED")


def test_seed_logprobs_and_stop_strings_through_the_mesh(gateway):
    """Sampling options survive gateway → queue → router → worker → result stream → client:
    the same seed gives the same tokens (another seed other tokens), logprobs come one per token,
    and a stop string ends the completion at the token that completes it, text cut before it.

    Seeds repeat under the same conditions: the prompt is cached before the seeded runs, since
    a cold prefill and a cached prefix differ in the last bits (README, "Sampling")."""
    def run(max_tokens=24, **sampling):
        req = _chat("Tell me about the moon and the stars.", max_tokens=max_tokens)
        for k, v in sampling.items():
            if k == "stop":
                req.sampling.stop.extend(v)
            else:
                setattr(req.sampling, k, v)
        chunks, _, final = _stream(gateway, req, "acme")
        return chunks, final

    def ids(chunks):
        return [i for c in chunks for i in c.token_ids]

    run(max_tokens=1)   # caches the prompt
    a, _ = run(temperature=0.9, seed=1234, logprobs=True)
    b, _ = run(temperature=0.9, seed=1234)
    c, _ = run(temperature=0.9, seed=99)
    assert ids(a) == ids(b) and ids(a) != ids(c)
    assert all(len(ch.logprobs) == len(ch.token_ids) for ch in a)
    assert all(lp <= 0.0 for ch in a for lp in ch.logprobs) and ids(a)

    greedy, final = run()
    text = "".join(ch.text for ch in greedy)
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    # A stop string that first appears a few tokens in: the first word of 4+ letters after the
    # opening 10 characters.
    word = next(w for w in text[10:].split() if len(w) >= 4 and w.isalpha())
    stopped, final = run(stop=[word])
    cut = "".join(ch.text for ch in stopped)
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP
    assert word not in cut and text.startswith(cut)
    assert ids(stopped) == ids(greedy)[:len(ids(stopped))] and len(ids(stopped)) < len(ids(greedy))
    assert final.usage.completion_tokens == len(ids(stopped))
