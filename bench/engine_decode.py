"""Engine decode throughput on the real GGUF: one sequence and N concurrent ones, per dtype.

    .venv/bin/python bench/engine_decode.py --dtypes float32 bfloat16 --concurrency 1 8 32 --threads 2

Decode tok/s counts only steps where every scheduled request decodes one token, so prefill
never inflates it; prefill tok/s is reported apart.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmmesh.models import resolve_model  # noqa: E402
from workers.engine import EngineConfig, EngineCore, SamplingParams  # noqa: E402


def run(core: EngineCore, concurrency: int, prompt_len: int, max_tokens: int, seed: int):
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(concurrency):
        prompt = [rng.randrange(core.vocab_size) for _ in range(prompt_len)]
        core.add_request(core.make_request(f"s{seed}-{i}", prompt, params))
    decode = [0, 0.0]
    prefill = [0, 0.0]
    while core.has_work():
        out = core.scheduler.schedule()
        started = time.perf_counter()
        runner_out = core.runner.execute(out)
        elapsed = time.perf_counter() - started
        core.scheduler.update_from_output(out, runner_out, elapsed)
        bucket = decode if max(out.num_scheduled_tokens) == 1 else prefill
        bucket[0] += out.total_num_scheduled_tokens
        bucket[1] += elapsed
    return decode[0] / decode[1], prefill[0] / prefill[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    gguf = resolve_model().gguf_path
    print(f"model {os.path.basename(gguf)}, device {args.device}, threads {args.threads}, "
          f"prompt {args.prompt_len}, {args.max_tokens} new tokens each", flush=True)
    print("| dtype | concurrent seqs | decode tok/s (aggregate) | per-seq decode tok/s | prefill tok/s |")
    print("|---|---|---|---|---|")
    for dtype in args.dtypes:
        config = EngineConfig(gguf_path=gguf, device=args.device, dtype=dtype,
                              num_threads=args.threads, max_num_seqs=max(args.concurrency))
        core = EngineCore(config)
        run(core, 2, 32, 4, seed=-1)                    # warm-up
        for n in args.concurrency:
            decode, prefill = run(core, n, args.prompt_len, args.max_tokens, seed=n)
            print(f"| {dtype} | {n} | {decode:.1f} | {decode / n:.1f} | {prefill:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
