"""Engine end to end on a tiny random fp32 model: exact greedy outputs against the model's own
reference path, prefix caching, preemption, cancellation, seeds and device-time accounting."""
from __future__ import annotations

import asyncio
import contextlib
import random

import pytest
import torch

from llmmesh.errors import AlreadyExists, InvalidArgument
from workers.engine import AsyncEngine, EngineConfig, EngineCore, Priority, SamplingParams
from workers.model import ModelConfig, build_random_model

MODEL_CONFIG = ModelConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
    max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None, eos_token_id=127)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return build_random_model(MODEL_CONFIG, "cpu", torch.float32, seed=0)


@pytest.fixture(scope="module")
def reference(model):
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.inference_mode()
    def greedy(prompt: list[int], max_tokens: int = GREEDY.max_tokens) -> list[int]:
        """Solo greedy decode through the model's cache-free causal path."""
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            tokens = list(prompt)
            for _ in range(max_tokens):
                hidden = model(torch.tensor(tokens), torch.arange(len(tokens)))
                tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
            cache[key] = tokens[len(prompt):]
        return cache[key]
    return greedy


def engine_config(**overrides) -> EngineConfig:
    values = {"block_size": 4, "num_gpu_blocks": 256, "max_num_batched_tokens": 32}
    return EngineConfig(**{**values, **overrides})


def prompts(count: int, seed: int, low: int = 4, high: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 127) for _ in range(rng.randint(low, high))] for _ in range(count)]


def run_core(core: EngineCore, requests: dict[str, list[int]], sampling=GREEDY, **kwargs):
    """Add all requests, step until idle; returns (tokens by id, final output by id)."""
    for request_id, prompt in requests.items():
        core.add_request(core.make_request(request_id, prompt, sampling, **kwargs))
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    finals = {}
    while core.has_work():
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                finals[output.request_id] = output
    return tokens, finals


def test_batched_chunked_decoding_matches_solo_reference(model, reference):
    core = EngineCore(engine_config(max_num_batched_tokens=16), model)
    requests = {f"r{i}": p for i, p in enumerate(prompts(6, seed=1, high=40))}
    tokens, finals = run_core(core, requests)
    assert tokens == {rid: reference(p) for rid, p in requests.items()}
    assert all(f.finish_reason == "length" and f.usage.completion_tokens == 8
               for f in finals.values())
    assert core.load().num_free_blocks == core.cache_info.num_blocks


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_on_or_off_gives_identical_outputs(model, reference, caching):
    core = EngineCore(engine_config(enable_prefix_caching=caching), model)
    shared = prompts(1, seed=2, low=24, high=24)[0]
    first, _ = run_core(core, {"first": shared + [5, 6]})
    suffixes = {f"s{i}": shared + p for i, p in enumerate(prompts(4, seed=3, low=1, high=9))}
    tokens, finals = run_core(core, suffixes)
    assert first["first"] == reference(shared + [5, 6])
    assert tokens == {rid: reference(p) for rid, p in suffixes.items()}
    cached = {f.usage.cached_prompt_tokens for f in finals.values()}
    assert cached == ({24} if caching else {0})


def test_prefix_hits_stay_inside_their_salt(model):
    core = EngineCore(engine_config(), model)
    prompt = prompts(1, seed=4, low=20, high=20)[0]
    run_core(core, {"a": prompt}, cache_salt="tenant-1")
    _, same = run_core(core, {"b": prompt}, cache_salt="tenant-1")
    _, other = run_core(core, {"c": prompt}, cache_salt="tenant-2")
    assert same["b"].usage.cached_prompt_tokens == 16          # last block holds the last token
    assert other["c"].usage.cached_prompt_tokens == 0


def test_preemption_in_a_tiny_pool_leaves_outputs_unchanged(model, reference):
    core = EngineCore(engine_config(num_gpu_blocks=16, max_num_batched_tokens=64), model)
    requests = {f"r{i}": p for i, p in enumerate(prompts(8, seed=5, low=10, high=14))}
    sampling = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    tokens, finals = run_core(core, requests, sampling)
    assert sum(f.usage.num_preemptions for f in finals.values()) > 0
    assert tokens == {rid: reference(p, 16) for rid, p in requests.items()}
    assert core.load().num_free_blocks == 16


def test_device_seconds_are_positive_and_split_by_kind(model):
    core = EngineCore(engine_config(), model)
    _, finals = run_core(core, {"a": list(range(1, 20)), "b": list(range(2, 30))})
    for final in finals.values():
        assert final.usage.prefill_device_s > 0 and final.usage.decode_device_s > 0
        assert final.usage.queue_s >= 0


def test_seeded_sampling_is_reproducible_whatever_the_batch(model):
    prompt = list(range(1, 12))

    def sample(seed: int, neighbours: int, **extra) -> list[int]:
        core = EngineCore(engine_config(), model)
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True,
                                **extra)
        batch = {f"n{i}": p for i, p in enumerate(prompts(neighbours, seed=6))}
        tokens, _ = run_core(core, {**batch, "x": prompt}, params)
        return tokens["x"]

    alone = sample(123, neighbours=0)
    assert sample(123, neighbours=5) == alone
    assert sample(124, neighbours=0) != alone
    truncated = sample(123, neighbours=3, top_k=5, top_p=0.9)
    assert truncated == sample(123, neighbours=0, top_k=5, top_p=0.9)


def test_logprobs_are_returned_when_asked(model, reference):
    core = EngineCore(engine_config(), model)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=True)
    core.add_request(core.make_request("a", [1, 2, 3], params))
    outputs = []
    while core.has_work():
        outputs += core.step()
    assert [o.new_token_ids[0] for o in outputs] == reference([1, 2, 3], 4)
    assert all(len(o.new_logprobs) == 1 and o.new_logprobs[0] <= 0 for o in outputs)


@pytest.mark.parametrize("prompt, field", [([], "prompt_token_ids"), ([1, 128], "prompt_token_ids"),
                                           ([1] * 512, "prompt_token_ids")])
def test_bad_requests_are_refused_naming_the_field(model, prompt, field):
    core = EngineCore(engine_config(), model)
    with pytest.raises(InvalidArgument, match=field):
        core.make_request("a", prompt, GREEDY)
    with pytest.raises(InvalidArgument, match="priority"):
        core.make_request("a", [1], GREEDY, priority=7)
    with pytest.raises(InvalidArgument, match="sampling.top_p"):
        SamplingParams(top_p=0)


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int], **kwargs):
    tokens, final = [], None
    async for output in engine.generate(request_id, prompt, GREEDY, **kwargs):
        tokens += output.new_token_ids
        final = output
    return tokens, final


def test_cancelling_10_of_100_leaves_the_other_90_exact_and_no_blocks_leaked(model, reference):
    requests = {f"r{i}": p for i, p in enumerate(prompts(100, seed=7))}
    cancelled = {f"r{i}" for i in range(0, 100, 10)}

    endless = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)

    async def consume_then_leave(request_id: str, started: asyncio.Event) -> None:
        # Unaborted, these would still hold blocks when the probe below ends.
        stream = engine.generate(request_id, requests[request_id], endless)
        async with contextlib.aclosing(stream):
            async for _ in stream:
                started.set()
                if int(request_id[1:]) % 20 == 0:
                    return                          # half leave by closing the stream
                await asyncio.Event().wait()        # the other half are cancelled as tasks

    async def main():
        await engine.start()
        try:
            started = {rid: asyncio.Event() for rid in cancelled}
            tasks = {rid: asyncio.create_task(
                consume_then_leave(rid, started[rid]) if rid in cancelled
                else collect(engine, rid, prompt)) for rid, prompt in requests.items()}
            for rid in cancelled:
                await started[rid].wait()
                tasks[rid].cancel()
            results = {rid: await tasks[rid] for rid in requests if rid not in cancelled}
            # Commands are applied in order: once this probe ends, every abort has been applied.
            await collect(engine, "probe", [1, 2, 3])
            return results, engine.load()
        finally:
            await engine.shutdown()

    engine = AsyncEngine(engine_config(num_gpu_blocks=128), model)
    results, load = asyncio.run(main())
    assert {rid: tokens for rid, (tokens, _) in results.items()} == {
        rid: reference(p) for rid, p in requests.items() if rid not in cancelled}
    assert all(final.usage.completion_tokens == 8 for _, final in results.values())
    assert (load.num_running, load.num_waiting) == (0, 0)
    assert load.num_free_blocks == load.num_total_blocks == 128


def test_abort_ends_the_stream_and_unknown_ids_are_refused(model):
    async def main():
        engine = AsyncEngine(engine_config(), model)
        await engine.start()
        try:
            stream = engine.generate("a", [1, 2, 3], SamplingParams(max_tokens=400,
                                                                   temperature=0, ignore_eos=True))
            first = await anext(stream)
            with pytest.raises(AlreadyExists):
                await anext(engine.generate("a", [1], GREEDY))
            assert engine.abort("a") and not engine.abort("unknown")
            rest = [output async for output in stream]
            return first, rest
        finally:
            await engine.shutdown()

    first, rest = asyncio.run(main())
    assert not first.finished and rest[-1].finished and rest[-1].finish_reason == "cancelled"
    assert rest[-1].usage.completion_tokens < 400


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(model, reference):
    async def main():
        engine = AsyncEngine(engine_config(), model)
        await engine.start()
        execute = engine.core.runner.execute
        calls = []

        def fail_once(scheduler_output):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("device fell over")
            return execute(scheduler_output)

        engine.core.runner.execute = fail_once
        try:
            failed = await collect(engine, "a", [1, 2, 3])
            failing = engine.num_failed_steps   # the worker's health says NOT_SERVING meanwhile
            served = await collect(engine, "b", [4, 5, 6])
            return failed, failing, served, engine.load(), engine.num_failed_steps
        finally:
            await engine.shutdown()

    (_, failed), failing, (tokens, served), load, after = asyncio.run(main())
    assert failed.finish_reason == "error" and "device fell over" in failed.error
    assert failing == 1 and after == 0   # a step that succeeds again clears it
    assert served.finish_reason == "length" and tokens == reference([4, 5, 6])
    assert load.num_free_blocks == load.num_total_blocks


def test_interactive_priority_reaches_the_engine(model):
    core = EngineCore(engine_config(max_num_seqs=1), model)
    core.add_request(core.make_request("batch", [1, 2], GREEDY, priority=Priority.BATCH))
    core.add_request(core.make_request("chat", [3, 4], GREEDY, priority=Priority.INTERACTIVE))
    assert [o.request_id for o in core.step()] == ["chat"]


def test_calibration_teaches_the_step_model_and_leaves_nothing_behind(model, reference):
    core = EngineCore(engine_config(), model)
    assert not core.scheduler.step_cost.ready
    core.calibrate()
    fixed, per_token, per_kkey = core.scheduler.step_cost.coefficients()
    assert core.scheduler.step_cost.ready and min(fixed, per_token, per_kkey) >= 0
    # It learned that work costs time: a 64-token prefill more than one decode. (Which term
    # carries it is timing noise on this 2-layer model: per_token alone came out 0 once.)
    cost = core.scheduler.step_cost
    assert cost.predict(64, 64 * 65 // 2) > cost.predict(1, 1)
    pool = core.scheduler.kv.pool
    assert not core.has_work() and not core.scheduler.requests
    assert pool.num_free_blocks == pool.num_blocks            # nothing in use (cached is free)
    assert core.load().prefix_cache_hit_rate == 0.0
    assert core.load().cached_block_hashes == () and not pool.cached   # none to publish
    # Its cache salt is its own: a user's prompt never hits calibration blocks.
    tokens, finals = run_core(core, {"a": [5, 6, 7, 8, 9, 10, 11, 12, 13]})
    assert finals["a"].usage.cached_prompt_tokens == 0
    assert tokens["a"] == reference([5, 6, 7, 8, 9, 10, 11, 12, 13])
    with pytest.raises(RuntimeError):
        core.add_request(core.make_request("busy", [1, 2, 3], GREEDY))
        core.calibrate()


def test_an_fp16_kv_cache_holds_twice_the_blocks_and_serves_batches():
    """--kv-cache-dtype float16: the same memory budget holds twice the blocks, the cache
    tensors are fp16, and a chunked batch decodes through it close to the fp32 cache's tokens
    (fp16 rounds K and V: a greedy token may differ, so most, not all, must agree)."""
    model = build_random_model(MODEL_CONFIG, "cpu", torch.float32, seed=0)
    budget = {"num_gpu_blocks": None, "kv_cache_bytes": 1 << 20, "max_num_batched_tokens": 16}
    wide = EngineCore(engine_config(**budget), model)
    narrow = EngineCore(engine_config(kv_cache_dtype="float16", **budget), model)
    assert narrow.cache_info.num_blocks == 2 * wide.cache_info.num_blocks
    assert narrow.runner.kv_caches[0].dtype == torch.float16
    assert wide.runner.kv_caches[0].dtype == torch.float32          # "auto": the activations'
    requests = {f"r{i}": p for i, p in enumerate(prompts(6, seed=4, high=40))}
    fp32, _ = run_core(wide, requests)
    fp16, finals = run_core(narrow, requests)
    assert all(len(t) == 8 for t in fp16.values())
    agree = sum(a == b for rid in requests for a, b in zip(fp32[rid], fp16[rid]))
    assert agree >= 0.75 * 8 * len(requests), (fp32, fp16)
    assert narrow.load().num_free_blocks == narrow.cache_info.num_blocks
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine_config(kv_cache_dtype="int3")
