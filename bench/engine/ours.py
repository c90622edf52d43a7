"""Our engine measured directly through EngineCore (no gRPC, no asyncio): the model and batching.

Decode tok/s counts only steps where every scheduled request decodes one token (what
llama-batched-bench's S_TG counts); prefill tok/s comes from a run of max_tokens=1 requests, so
every step is prompt work. TTFT with a cached prefix uses the engine's own prefix cache.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from bench.engine import roofline
from llmmesh.tokenizer import Tokenizer
from workers.engine import EngineConfig, EngineCore, SamplingParams
from workers.model.perplexity import (decode_logprobs, divergence, evaluation_text, perplexity,
                                      reference_logprobs)
from workers.model.quantize import weight_bytes


@dataclass
class ModeResult:
    mode: str
    prefill_tps: dict[int, float] = field(default_factory=dict)     # concurrency -> tok/s
    decode_tps: dict[int, float] = field(default_factory=dict)
    e2e_tps: dict[int, float] = field(default_factory=dict)         # generated tokens / wall
    ttft_uncached_s: float | None = None
    ttft_cached_s: float | None = None
    perplexity: float | None = None
    kl_vs_fp32: float | None = None        # decode path vs the fp32 reference, nats per token
    top1_vs_fp32: float | None = None      # share of positions with the reference's top token
    weight_bytes: dict[str, int] = field(default_factory=dict)
    linear_params: int = 0                 # weights a decode step multiplies by (roofline)
    prefill_params: int = 0                # ... and a prompt token
    kv_read_per_seq: float = 0.0           # KV bytes a decode step reads per sequence (roofline)


def build_engine(gguf_path: str, mode: str, device: str, threads: int,
                 max_num_seqs: int) -> EngineCore:
    config = EngineConfig(gguf_path=gguf_path, device=device, quantization=mode,
                          num_threads=threads, max_num_seqs=max_num_seqs)
    return EngineCore(config)


def _prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    # Random ids, as llama-bench uses: the cost of a step does not depend on the text.
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def _submit(core: EngineCore, prompts: list[list[int]], max_tokens: int, tag: str) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(core.make_request(f"{tag}-{i}", prompt, params))


def _drain(core: EngineCore) -> tuple[int, float, float]:
    """Run to completion: (decode tokens, decode-step seconds, wall seconds)."""
    decode_tokens, decode_s, started = 0, 0.0, time.perf_counter()
    while core.has_work():
        out = core.scheduler.schedule()
        if out.is_empty:
            continue
        t0 = time.perf_counter()
        runner_out = core.runner.execute(out)
        elapsed = time.perf_counter() - t0
        core.scheduler.update_from_output(out, runner_out, elapsed)
        if max(out.num_scheduled_tokens) == 1:
            decode_tokens += out.total_num_scheduled_tokens
            decode_s += elapsed
    return decode_tokens, decode_s, time.perf_counter() - started


def measure_throughput(core: EngineCore, concurrency: int, prompt_len: int, new_tokens: int,
                       seed: int) -> tuple[float, float, float]:
    """(prefill tok/s, decode tok/s, end-to-end generated tok/s) at `concurrency` sequences."""
    rng = random.Random(seed)
    prompts = _prompts(rng, concurrency, prompt_len, core.vocab_size)
    _submit(core, prompts, 1, f"pf{seed}")
    _, _, prefill_wall = _drain(core)
    # Fresh prompts, so the decode run's prefill is not served from the prefix cache.
    _submit(core, _prompts(rng, concurrency, prompt_len, core.vocab_size), new_tokens,
            f"dc{seed}")
    decode_tokens, decode_s, wall = _drain(core)
    return (concurrency * prompt_len / prefill_wall, decode_tokens / max(decode_s, 1e-9),
            concurrency * new_tokens / wall)


def _time_to_first_token(core: EngineCore, prompt: list[int], tag: str) -> float:
    _submit(core, [prompt], 1, tag)
    started = time.perf_counter()
    while core.has_work():
        for output in core.step():
            if output.new_token_ids:
                elapsed = time.perf_counter() - started
                _drain(core)
                return elapsed
    raise RuntimeError("request finished without a token")


def measure_ttft(core: EngineCore, cached_len: int, suffix_len: int, seed: int
                 ) -> tuple[float, float]:
    """(uncached, cached) TTFT of a cached_len + suffix_len prompt; in the cached case its first
    cached_len tokens were computed by an earlier request."""
    rng = random.Random(seed)
    prefix = _prompts(rng, 1, cached_len, core.vocab_size)[0]
    suffixes = _prompts(rng, 3, suffix_len, core.vocab_size)
    uncached = _time_to_first_token(core, prefix + suffixes[0], f"ttft-u{seed}")
    cached = _time_to_first_token(core, prefix + suffixes[1], f"ttft-c{seed}")
    return uncached, cached


def quality_ids(gguf_path: str, num_tokens: int) -> list[int]:
    return Tokenizer.from_gguf(gguf_path).encode(evaluation_text())[:num_tokens + 1]


def reference(gguf_path: str, num_tokens: int) -> torch.Tensor:
    """The fp32 reference's next-token log-probabilities on the first `num_tokens` tokens of
    the evaluation text (the dequantized GGUF, the reference causal path)."""
    from workers.model.loader import load_model
    model, _ = load_model(gguf_path, quantization="fp32")
    return reference_logprobs(model, quality_ids(gguf_path, num_tokens)[:num_tokens])


def measure_quality(result: ModeResult, core: EngineCore, gguf_path: str, num_tokens: int,
                    ref: torch.Tensor | None) -> None:
    model = core.runner.model
    ids = quality_ids(gguf_path, num_tokens)
    # The serving path: paged KV cache, the fused decoder stack and its prefill GEMMs.
    result.perplexity, result.weight_bytes = perplexity(model, ids, paged=True), weight_bytes(model)
    if ref is not None:   # and the decode path, where every projection runs at batch 1
        result.kl_vs_fp32, result.top1_vs_fp32 = divergence(
            ref, decode_logprobs(model, ids[:ref.shape[0]]))


def warm_up(core: EngineCore) -> None:
    """First calls pay one-off costs (allocator growth, OpenMP pool start, page faults)."""
    measure_throughput(core, 2, 32, 4, seed=-1)


def quality_only(gguf_path: str, mode: str, *, device: str, threads: int,
                 ppl_tokens: int, ref: torch.Tensor | None = None) -> ModeResult:
    """Perplexity and weight bytes without throughput runs (bf16 on a CPU without bf16 units
    is 2-7x slower than fp32 here and would double the benchmark's length)."""
    core = build_engine(gguf_path, mode, device, threads, 1)
    result = ModeResult(mode)
    with torch.inference_mode():
        measure_quality(result, core, gguf_path, ppl_tokens, ref)
    return result


def run_mode(gguf_path: str, mode: str, *, device: str, threads: int, concurrency: list[int],
             prompt_len: int, new_tokens: int, ppl_tokens: int, repeats: int,
             ref: torch.Tensor | None = None) -> ModeResult:
    core = build_engine(gguf_path, mode, device, threads, max(concurrency))
    result = ModeResult(mode)
    with torch.inference_mode():
        warm_up(core)
        for n in concurrency:
            runs = [measure_throughput(core, n, prompt_len, new_tokens, seed=1000 * r + n)
                    for r in range(repeats)]
            # Best of the repeats: on a shared host the fastest run is the least disturbed.
            result.prefill_tps[n] = max(r[0] for r in runs)
            result.decode_tps[n] = max(r[1] for r in runs)
            result.e2e_tps[n] = max(r[2] for r in runs)
        ttfts = [measure_ttft(core, 512, 32, seed=7 + r) for r in range(repeats)]
        result.ttft_uncached_s = min(t[0] for t in ttfts)
        result.ttft_cached_s = min(t[1] for t in ttfts)
        if ppl_tokens:
            measure_quality(result, core, gguf_path, ppl_tokens, ref)
        else:
            result.weight_bytes = weight_bytes(core.runner.model)
        result.linear_params, result.prefill_params = roofline.linear_params(core.runner.model)
        # Decode steps run at contexts prompt_len + 1 .. prompt_len + new_tokens - 1.
        result.kv_read_per_seq = roofline.kv_read_per_step(
            core.runner.model, core.runner.kv_caches[0].dtype,
            prompt_len + new_tokens / 2)
    return result
