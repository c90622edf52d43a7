"""The peers on the same GGUF and thread count: llama.cpp (llama-bench, llama-batched-bench) and
HF transformers (plain `generate`, and its continuous-batching `generate_batch` when present)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import time
from dataclasses import dataclass, field

import torch

from bench.peers.llamacpp import (Builds, batched_bench_argv, batched_bench_rows, llamacpp_bin,
                                  llamacpp_builds)

CELLS = ("prefill_tps", "decode_tps", "e2e_tps")


@dataclass
class PeerResult:
    name: str
    prefill_tps: dict[int, float] = field(default_factory=dict)
    decode_tps: dict[int, float] = field(default_factory=dict)
    e2e_tps: dict[int, float] = field(default_factory=dict)
    note: str = ""
    fallbacks: list[str] = field(default_factory=list)
    # llama.cpp: each build's own cells, of which the cells above keep the best
    builds: dict[str, PeerResult] = field(default_factory=dict)


def _run_json(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, check=True, text=True, capture_output=True, timeout=timeout_s,
                          env=env)
    return done.stdout


def llamacpp(gguf_path: str, threads: int, concurrency: list[int], prompt_len: int,
             new_tokens: int, repeats: int, builds: Builds | None = None) -> PeerResult:
    """Best per cell over the builds that differ on this CPU (llamacpp_builds) and, per build,
    over OpenMP threads sleeping (PASSIVE) and spinning (its default): on a loaded host
    spinning collapsed its batched decode ~10x, on a quiet one it is faster."""
    builds = builds or llamacpp_builds()
    spinning = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    per_build = {}
    for variant in builds.variants:
        one = per_build[variant] = PeerResult(f"llama.cpp {variant}")
        # Spinning gets one try: under load its 32-sequence run took 4+ minutes.
        for env, tries in (({**spinning, "OMP_WAIT_POLICY": "PASSIVE"}, repeats), (spinning, 1)):
            _llamacpp_once(one, variant, env, gguf_path, threads, concurrency, prompt_len,
                           new_tokens, tries)
    result = best_per_cell("llama.cpp", per_build)
    result.note = ("best per cell of OMP_WAIT_POLICY=PASSIVE (best of the repeats) and unset "
                   f"(spinning, one try); builds: {builds.reason}")
    if result.fallbacks:
        result.note += "; " + "; ".join(sorted(set(result.fallbacks)))
    return result


def best_per_cell(name: str, per_build: dict[str, PeerResult]) -> PeerResult:
    """One result holding each cell's best over the builds, and the builds themselves."""
    result = PeerResult(name, builds=per_build)
    for one in per_build.values():
        for cell in CELLS:
            for n, value in getattr(one, cell).items():
                _keep_best(getattr(result, cell), n, value)
    named = len(per_build) > 1
    result.fallbacks = [f"{variant} build: {f}" if named else f
                        for variant, one in per_build.items() for f in one.fallbacks]
    return result


def winning_build(result: PeerResult, cell: str, n: int) -> str | None:
    """The build whose figure a best-per-cell result kept (the first on a tie)."""
    timed = {v: getattr(one, cell)[n] for v, one in result.builds.items()
             if n in getattr(one, cell)}
    return max(timed, key=timed.__getitem__) if timed else None


def _run_with_repack_fallback(result: PeerResult, argv: list[str], no_repack: list[str],
                              what: str, env: dict[str, str]) -> str:
    try:
        return _run_json(argv, 1800, env)
    except subprocess.CalledProcessError as exc:
        out = _run_json(argv + no_repack, 1800, env)
        result.fallbacks.append(f"{what}: exit {exc.returncode} with weight repacking (the "
                                f"default), timed with {' '.join(no_repack)}")
        return out


def _keep_best(table: dict[int, float], key: int, value: float) -> None:
    table[key] = max(table.get(key, 0.0), value)


def _llamacpp_once(result: PeerResult, variant: str, env: dict[str, str], gguf_path: str,
                   threads: int, concurrency: list[int], prompt_len: int, new_tokens: int,
                   repeats: int) -> None:
    # Prompt and generation as separate llama-bench runs: a -march=native build on a CPU with
    # AMX crashed (SIGSEGV in ggml_backend_amx_mul_mat) on every multi-token batch with weight
    # repacking on, while single-token decode with repacking is its fastest path. Each cell
    # falls back to --repack 0 only if the default crashes, and the note says so.
    base = [llamacpp_bin("llama-bench", variant), "-m", gguf_path, "-t", str(threads),
            "-r", str(max(repeats, 2)), "-o", "json"]
    for test in (["-p", str(prompt_len), "-n", "0"], ["-p", "0", "-n", str(new_tokens)]):
        bench = json.loads(_run_with_repack_fallback(
            result, base + test, ["--repack", "0"], "llama-bench " + " ".join(test), env))
        for row in bench:
            _keep_best(result.prefill_tps if row["n_gen"] == 0 else result.decode_tps, 1,
                       row["avg_ts"])
    parallel = [n for n in concurrency if n > 1]
    if parallel:
        argv = batched_bench_argv(variant, gguf_path, threads, prompt_len, new_tokens, parallel)
        for _ in range(repeats):
            out = _run_with_repack_fallback(result, argv, ["--no-repack"],
                                            "llama-batched-bench", env)
            for row in batched_bench_rows(out):
                n = row["pl"]
                _keep_best(result.prefill_tps, n, row["speed_pp"])
                _keep_best(result.decode_tps, n, row["speed_tg"])
                _keep_best(result.e2e_tps, n, n * new_tokens / row["t"])


def _hf_model(gguf_path: str, dtype: torch.dtype):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=dtype)
    return model.eval()


def _hf_generate(model, batch: int, prompt_len: int, new_tokens: int, seed: int
                 ) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) for one padded-free batch of equal-length prompts."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    ids = torch.tensor([[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)])
    with torch.inference_mode():
        started = time.perf_counter()
        model(ids)
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        total_s = time.perf_counter() - started
    # generate's time is one prefill plus new_tokens - 1 decode steps.
    decode_s = max(total_s - prefill_s, 1e-9)
    return batch * prompt_len / prefill_s, batch * (new_tokens - 1) / decode_s


def hf_transformers(gguf_path: str, dtype: torch.dtype, concurrency: list[int],
                    prompt_len: int, new_tokens: int, decode: bool) -> PeerResult:
    name = "HF transformers " + ("fp32" if dtype == torch.float32 else "bf16")
    result = PeerResult(name)
    model = _hf_model(gguf_path, dtype)
    _hf_generate(model, 1, 16, 2, seed=-1)    # warm-up
    for n in concurrency:
        prefill, dec = _hf_generate(model, n, prompt_len, new_tokens if decode else 2, seed=n)
        result.prefill_tps[n] = prefill
        if decode:
            result.decode_tps[n] = dec
    return result


def hf_continuous_batching(gguf_path: str, concurrency: int, prompt_len: int,
                           new_tokens: int) -> PeerResult:
    """transformers' generate_batch (paged continuous batching), end-to-end tok/s."""
    result = PeerResult("HF generate_batch fp32")
    model = _hf_model(gguf_path, torch.float32)
    if not hasattr(model, "generate_batch"):
        result.note = "generate_batch not in this transformers"
        return result
    from transformers import GenerationConfig
    rng = random.Random(concurrency)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(prompt_len)]
               for _ in range(concurrency)]
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, eos_token_id=-1, pad_token_id=0)
    try:
        with torch.inference_mode():
            started = time.perf_counter()
            outputs = model.generate_batch(prompts, generation_config=config, progress_bar=False)
            wall = time.perf_counter() - started
    except Exception as exc:   # an experimental API: report, don't abort the whole run
        result.note = f"generate_batch failed: {type(exc).__name__}: {exc}"[:200]
        return result
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    result.e2e_tps[concurrency] = generated / wall
    return result
