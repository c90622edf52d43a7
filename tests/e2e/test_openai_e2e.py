"""The OpenAI-compatible HTTP front on the real mesh, with the official `openai` SDK as client
(sync and async, streaming and not) and curl: answers, usage equal to costd's ledger row, cached
tokens for the same tenant only, each error as the SDK's typed exception, a disconnect cancels
the work on the worker, the Batch API round trip seen from gRPC too."""
from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import time
import uuid

import grpc
import httpx
import openai
import pytest

from gateway.tenants import hash_key
from llmmesh.v1 import gateway_pb2, gateway_pb2_grpc
from tests.e2e.meshkit import DEMO_KEYS, auth, mesh_with_tenants, wait_until, worker_load

pytestmark = [pytest.mark.e2e, pytest.mark.model]
MODEL = "smollm2-135m-instruct"
KEYS = {**DEMO_KEYS, "narrow": "llmmesh-test-narrow", "slow": "llmmesh-test-slow"}


TENANTS = f"""
[tenants.acme]
api_key_sha256 = ["{hash_key(KEYS['acme'])}"]
cache_scope = "acme"

[tenants.globex]
api_key_sha256 = ["{hash_key(KEYS['globex'])}"]
cache_scope = "globex"

[tenants.narrow]
# May use batch only, and a model this mesh does not serve.
api_key_sha256 = ["{hash_key(KEYS['narrow'])}"]
allowed_classes = ["batch"]
allowed_models = ["some-other-model"]

[tenants.slow]
api_key_sha256 = ["{hash_key(KEYS['slow'])}"]
requests_per_minute = 1
"""


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with mesh_with_tenants(tmp_path_factory.mktemp("openai"), TENANTS) as m:
        yield m


def _client(mesh, tenant="acme", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.openai_base_url, api_key=KEYS[tenant], max_retries=0,
                         timeout=120, **kw)


def _aclient(mesh, tenant="acme") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=mesh.openai_base_url, api_key=KEYS[tenant], max_retries=0,
                              timeout=120)


def _ledger(mesh, request_id: str):
    conn = sqlite3.connect(f"{mesh.var_dir}/ledger.sqlite")
    try:
        return conn.execute(
            "SELECT tenant_id, request_class, prompt_tokens, cached_prompt_tokens, completion_tokens, "
            "decode_device_s FROM usage_records WHERE request_id = ?", (request_id,)).fetchone()
    finally:
        conn.close()


def _billed(mesh, request_id: str):
    return wait_until(lambda: _ledger(mesh, request_id), 20, what=f"the bill of {request_id}")


def _assert_billed_as_told(mesh, request_id, tenant, usage, cls="interactive"):
    row = _billed(mesh, request_id)
    assert row[:5] == (tenant, cls, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                       usage.completion_tokens), row
    return row


MESSAGES = [{"role": "user", "content": "What is the capital of Japan?"}]


def test_sync_and_async_streaming_and_not_answer_alike_and_are_billed_as_told(mesh):
    client = _client(mesh)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    whole = raw.parse()
    assert "Tokyo" in whole.choices[0].message.content
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.object == "chat.completion" and whole.model == MODEL
    _assert_billed_as_told(mesh, raw.headers["x-request-id"], "acme", whole.usage)

    with client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
                                        stream=True, stream_options={"include_usage": True}) as stream:
        chunks = list(stream)
        sync_id = stream.response.headers["x-request-id"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert text == whole.choices[0].message.content     # greedy: the same answer either way
    _assert_billed_as_told(mesh, sync_id, "acme", chunks[-1].usage)

    async def run_async():
        aclient = _aclient(mesh)
        a_whole = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                                        temperature=0)
        pieces, usage = [], None
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True})
        async for c in stream:
            if c.choices:
                pieces.append(c.choices[0].delta.content or "")
            usage = c.usage or usage
        await aclient.close()
        return a_whole, "".join(pieces), usage
    a_whole, a_text, a_usage = asyncio.run(run_async())
    assert a_whole.choices[0].message.content == a_text == text
    assert a_usage.completion_tokens == whole.usage.completion_tokens

    # The legacy completions endpoint: stop strings cut, logprobs per token.
    done = client.completions.create(model=MODEL, prompt="One, two, three, four,", max_tokens=24,
                                     temperature=0, stop=[" six"], logprobs=0)
    assert done.object == "text_completion" and " six" not in done.choices[0].text
    assert done.choices[0].finish_reason == "stop"
    assert len(done.choices[0].logprobs.tokens) == done.usage.completion_tokens
    assert all(lp <= 0 for lp in done.choices[0].logprobs.token_logprobs)


def test_cached_tokens_for_the_same_tenant_only(mesh):
    system = ("You are a careful assistant for a library. Answer in one short sentence. "
              f"Catalogue {uuid.uuid4().hex}: books, maps, journals, records, films and manuscripts "
              "are kept on four floors with reading rooms on each, open every day but Sunday.")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "When is it open?"}]
    usages = {}
    for n, tenant in enumerate(("acme", "acme", "globex")):
        raw = _client(mesh, tenant).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0)
        usages[n] = raw.parse().usage
        _assert_billed_as_told(mesh, raw.headers["x-request-id"], tenant, usages[n])
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert usages[1].prompt_tokens_details.cached_tokens >= 48        # three blocks or more
    assert usages[2].prompt_tokens_details.cached_tokens == 0         # another tenant's cache


def _status_of(fn) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        fn()
    return info.value


def test_each_error_is_the_sdks_typed_exception(mesh):
    ok = dict(model=MODEL, messages=MESSAGES, max_tokens=2)
    e = _status_of(lambda: openai.OpenAI(base_url=mesh.openai_base_url, api_key="wrong",
                                         max_retries=0).chat.completions.create(**ok))
    assert isinstance(e, openai.AuthenticationError) and e.code == "invalid_api_key"
    e = _status_of(lambda: _client(mesh, "narrow").chat.completions.create(**ok))
    assert isinstance(e, openai.PermissionDeniedError) and "some-other-model" in e.message
    e = _status_of(lambda: _client(mesh).chat.completions.create(**{**ok, "model": "gpt-17"}))
    assert isinstance(e, openai.NotFoundError) and MODEL in e.message and e.code == "model_not_found"
    for bad, param in (({"max_tokens": 0}, "max_tokens"), ({"n": 3}, "n"),
                       ({"temperature": 9}, "temperature"), ({"max_completion_tokens": 10**6},
                                                             "max_completion_tokens")):
        e = _status_of(lambda: _client(mesh).chat.completions.create(**{**ok, **bad}))
        assert isinstance(e, openai.BadRequestError) and e.param == param, (bad, e.body)
        assert e.body["message"].startswith(f"{param}: ")
    # A malformed body: 400 naming the body, never a 500.
    r = httpx.post(f"{mesh.openai_base_url}/chat/completions", content=b"{not json",
                   headers={"authorization": f"Bearer {KEYS['acme']}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"

    slow = _client(mesh, "slow")
    assert slow.chat.completions.create(**ok).choices[0].message.content is not None
    e = _status_of(lambda: slow.chat.completions.create(**ok))
    assert isinstance(e, openai.RateLimitError) and e.code == "rate_limit_exceeded"
    assert 1 <= int(e.response.headers["retry-after"]) <= 60
    assert int(e.response.headers["retry-after-ms"]) > 0

    # A deadline (the timeout header) that generation cannot meet: 504, and the worker stops.
    e = _status_of(lambda: _client(mesh).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a very long story."}],
        max_tokens=400, extra_headers={"x-request-timeout": "0.4"}))
    assert e.status_code == 504 and isinstance(e, openai.InternalServerError)
    wait_until(lambda: worker_load(mesh.procs["worker0"].address).num_running == 0, 5,
               what="the worker to drop the request past its deadline")


def test_the_plan_caps_the_class_and_flex_means_batch(mesh):
    client = _client(mesh)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                                           service_tier="flex")
    assert raw.parse().service_tier == "flex"
    _assert_billed_as_told(mesh, raw.headers["x-request-id"], "acme", raw.parse().usage, "batch")
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, extra_headers={"x-llmmesh-class": "batch"})
    assert raw.parse().service_tier == "flex"
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert raw.parse().service_tier == "default"
    _assert_billed_as_told(mesh, raw.headers["x-request-id"], "acme", raw.parse().usage, "interactive")


def test_a_disconnected_stream_cancels_the_work_on_the_worker(mesh):
    address = mesh.procs["worker0"].address
    wait_until(lambda: worker_load(address).num_running == 0, 60, what="an idle worker")
    client = _client(mesh)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a very long story about a dragon."}],
        max_tokens=300, temperature=0, stream=True)
    request_id = stream.response.headers["x-request-id"]
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 3:
            break
    assert worker_load(address).num_running == 1
    stream.close()
    closed_at = time.monotonic()
    wait_until(lambda: worker_load(address).num_running == 0, 5, interval_s=0.005,
               what="the worker to drop the disconnected request")
    elapsed = time.monotonic() - closed_at
    assert elapsed < 0.5, f"the worker still ran the request {elapsed:.3f}s after the disconnect"
    # What was generated is billed, once, and it is less than asked for.
    row = _billed(mesh, request_id)
    assert row[0] == "acme" and 3 <= row[4] < 300


def test_curl_sees_sse_chunks_before_the_completion_ends(mesh):
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 64, "temperature": 0,
                       "messages": [{"role": "user", "content": "Write a long story about a cat."}]})
    proc = subprocess.Popen(
        ["curl", "-N", "-s", "--max-time", "120", f"{mesh.openai_base_url}/chat/completions",
         "-H", f"Authorization: Bearer {KEYS['acme']}", "-H", "Content-Type: application/json",
         "-D", "/dev/stderr", "-d", body], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    arrivals, payloads = [], []
    for line in proc.stdout:
        if line.startswith(b"data: "):
            arrivals.append(time.monotonic())
            payloads.append(line[6:].strip())
    proc.wait(30)
    headers = proc.stderr.read().decode().lower()
    assert payloads[-1] == b"[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len(chunks) >= 20
    assert "text/event-stream" in headers
    request_id = next(h.split(":", 1)[1].strip() for h in headers.splitlines() if h.startswith("x-request-id"))
    decode_s = _billed(mesh, request_id)[5]
    # The chunks arrive spread over the decode, not in one piece at its end.
    spread = arrivals[-1] - arrivals[1]
    assert spread >= 0.5 * decode_s > 0, (spread, decode_s)
    assert len({round(a, 3) for a in arrivals}) >= 10


def _batch_file(n: int) -> bytes:
    lines = [{"custom_id": f"item-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "max_tokens": 6, "temperature": 0,
                       "messages": [{"role": "user", "content": f"Say the number {i}."}]}}
             for i in range(n)]
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def test_batch_api_round_trip_seen_from_grpc_too(mesh):
    client = _client(mesh)
    upload = client.files.create(file=("requests.jsonl", _batch_file(20)), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes > 0
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"description": "twenty"})
    assert batch.status in ("in_progress", "completed") and batch.request_counts.total == 20

    def done():
        b = client.batches.retrieve(batch.id)
        return b if b.status == "completed" else None
    finished = wait_until(done, 180, interval_s=0.5, what="the batch to complete")
    assert finished.request_counts.completed == 20 and finished.request_counts.failed == 0
    lines = [json.loads(x) for x in client.files.content(finished.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in lines] == [f"item-{i}" for i in range(20)]
    for x in lines:
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and x["error"] is None
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        assert 1 <= body["usage"]["completion_tokens"] <= 6
        row = _billed(mesh, x["response"]["request_id"])
        assert row[:3] == ("acme", "batch", body["usage"]["prompt_tokens"])
        assert row[4] == body["usage"]["completion_tokens"]
    assert [b.id for b in client.batches.list(limit=5).data][0] == batch.id

    # The same job through the gRPC door.
    with grpc.insecure_channel(mesh.procs["gateway"].address) as channel:
        job = gateway_pb2_grpc.GatewayServiceStub(channel).GetBatch(
            gateway_pb2.GetBatchRequest(job_id=batch.id), metadata=auth(KEYS["acme"]), timeout=10)
    assert (job.num_requests, job.num_completed, job.display_name) == (20, 20, "twenty")
    assert job.status == gateway_pb2.BATCH_STATUS_COMPLETED
    assert job.completion_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in lines)

    # Tenant walls: another tenant sees neither the batch nor its files.
    other = _client(mesh, "globex")
    for fn in (lambda: other.batches.retrieve(batch.id),
               lambda: other.files.content(finished.output_file_id),
               lambda: other.files.retrieve(upload.id)):
        assert isinstance(_status_of(fn), openai.NotFoundError)


def test_cancelling_a_batch_ends_its_unfinished_requests(mesh):
    client = _client(mesh)
    lines = [{"custom_id": f"long-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "max_tokens": 200,
                       "messages": [{"role": "user", "content": f"Write a long story, number {i}."}]}}
             for i in range(12)]
    upload = client.files.create(file=("long.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")

    def cancelled():
        b = client.batches.retrieve(batch.id)
        return b if b.status == "cancelled" else None
    done = wait_until(cancelled, 60, interval_s=0.3, what="the batch to be cancelled")
    counts = done.request_counts
    assert counts.completed + counts.failed == 12 and counts.failed >= 6
    outputs = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()] \
        if done.output_file_id else []
    assert len(outputs) == counts.completed     # only whole completions in the output file
    assert all(o["response"]["body"]["choices"][0]["finish_reason"] in ("stop", "length") for o in outputs)
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert len(errors) == counts.failed
    assert {e["error"]["code"] for e in errors} == {"cancelled"}
    assert {e["custom_id"] for e in errors} <= {f"long-{i}" for i in range(12)}
    with grpc.insecure_channel(mesh.procs["gateway"].address) as channel:
        job = gateway_pb2_grpc.GatewayServiceStub(channel).GetBatch(
            gateway_pb2.GetBatchRequest(job_id=batch.id), metadata=auth(KEYS["acme"]), timeout=10)
    assert job.status == gateway_pb2.BATCH_STATUS_CANCELLED and job.num_failed == counts.failed


def test_a_bad_batch_line_is_named_and_nothing_is_queued(mesh):
    client = _client(mesh)
    lines = _batch_file(3).decode().splitlines()
    bad = json.loads(lines[1])
    bad["body"]["max_tokens"] = 0
    lines[1] = json.dumps(bad)
    upload = client.files.create(file=("bad.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    e = _status_of(lambda: client.batches.create(input_file_id=upload.id,
                                                 endpoint="/v1/chat/completions", completion_window="24h"))
    assert isinstance(e, openai.BadRequestError) and e.param == "input_file_id"
    assert "line 2" in e.message and "max_tokens" in e.message
    e = _status_of(lambda: client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune"))
    assert isinstance(e, openai.BadRequestError) and e.param == "purpose"


def test_health_tells_the_truth_and_a_dead_queue_store_is_503(mesh):
    """Last in the module: it restarts Redis (the store's contents go with it)."""
    base = mesh.openai_base_url.removesuffix("/v1")
    assert httpx.get(f"{base}/health").status_code == 200
    mesh.stop_one("redis", 9)
    try:
        wait_until(lambda: httpx.get(f"{base}/health").status_code == 503, 10,
                   what="health to say not serving")
        e = _status_of(lambda: _client(mesh).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                                      max_tokens=2))
        assert e.status_code == 503 and isinstance(e, openai.InternalServerError)
    finally:
        mesh.restart_redis()
    wait_until(lambda: httpx.get(f"{base}/health").status_code == 200, 30, what="health back")
