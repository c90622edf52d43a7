"""`make bench-engine`: our engine per weight mode vs llama.cpp vs HF transformers, same run.

    .venv/bin/python -m bench.engine                  # full: 1/8/32 seqs, 128 + 128 tokens
    .venv/bin/python -m bench.engine --quick          # smoke: 1/8 seqs, 16 new tokens, int4 only
    .venv/bin/python -m bench.engine --device cuda    # our part on a GPU (peers stay on the CPU)

Writes bench/results/engine.md (+ .png). All parties get the same thread count; OpenMP threads
sleep when idle (OMP_WAIT_POLICY=PASSIVE) because spinning threads on a shared 2-core host
steal the other party's core.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads libgomp

import torch  # noqa: E402

from bench.engine import ours, peers, roofline  # noqa: E402
from bench.engine.report import write_report  # noqa: E402
from bench.engine.verdicts import verdicts  # noqa: E402
from bench.environment import environment  # noqa: E402
from bench.peers.llamacpp import llamacpp_version  # noqa: E402
from llmmesh.models import resolve_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent.parent / "results"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.engine")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["int4", "int8", "fp32"],
                   help="weight modes timed end to end (the first is checked against targets)")
    p.add_argument("--quality-modes", nargs="*", default=["bf16"],
                   help="modes measured for perplexity and weight bytes only")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="best of N per cell")
    p.add_argument("--ppl-tokens", type=int, default=1024)
    p.add_argument("--kl-tokens", type=int, default=256,
                   help="tokens decoded one at a time per mode for KL / top-1 vs fp32 (0, or "
                        "--ppl-tokens 0: skip)")
    p.add_argument("--skip-peers", action="store_true", help="ours only")
    p.add_argument("--quick", action="store_true", help="short smoke run (~1-2 min)")
    p.add_argument("--out", default=str(RESULTS / "engine.md"))
    args = p.parse_args(argv)
    if args.quick:
        args.modes, args.quality_modes, args.concurrency = ["int4"], [], [1, 8]
        args.new_tokens, args.repeats, args.ppl_tokens, args.kl_tokens = 16, 1, 128, 32
    return args


def _run_peers(args, gguf: str) -> list[peers.PeerResult]:
    results = [peers.llamacpp(gguf, args.threads, args.concurrency, args.prompt_len,
                              args.new_tokens, args.repeats)]
    torch.set_num_threads(args.threads)
    results.append(peers.hf_transformers(gguf, torch.float32, args.concurrency,
                                         args.prompt_len, args.new_tokens, decode=True))
    # bf16 for prefill only (the prefill target); its decode is 2x slower than fp32
    # here (no AVX-512 bf16), so timing it would only lengthen the run.
    results.append(peers.hf_transformers(gguf, torch.bfloat16, args.concurrency,
                                         args.prompt_len, args.new_tokens, decode=False))
    if not args.quick:
        results.append(peers.hf_continuous_batching(gguf, max(args.concurrency),
                                                    args.prompt_len, args.new_tokens))
    return results


def _header(args, argv: list[str], started: float, env: dict) -> list[str]:
    load_end = [round(x, 2) for x in os.getloadavg()]
    command = "python -m bench.engine " + shlex.join(argv) if argv else "make bench-engine"
    return [
        "# Engine benchmark: ours vs llama.cpp vs HF transformers", "",
        f"- command: `{command}`",
        f"- machine: {env['machine']}; load average at start {env['load_average_at_start']}, "
        f"at end {load_end} (a shared host: compare rows of this run, not other runs)",
        f"- device (ours): {args.device}; threads: {args.threads} for every party; "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; CPU GEMM tiles: {_kernel_isa()}; "
        f"KV cache: {_kv_cache_dtype(args.device)}",
        f"- workload: {args.prompt_len}-token prompts, {args.new_tokens} greedy tokens, "
        f"{', '.join(map(str, args.concurrency))} concurrent sequences; best of {args.repeats}",
        f"- versions: python {env['python']}, torch {torch.__version__}, transformers "
        f"{_version('transformers')}, llama.cpp from llama-cpp-python {llamacpp_version()}; "
        f"commit {env['commit']}",
        f"- wall time: {time.time() - started:.0f} s",
        "- prefill @1 for llama.cpp is llama-bench pp; @N>1 llama-batched-bench S_PP. Decode @1 "
        "is tg, @N S_TG; HF decode = (generate - one prefill) / tokens; ours counts pure-decode "
        "steps; end-to-end = generated tokens / wall time of the whole batch.",
    ]


def _kv_cache_dtype(device: str) -> str:
    from workers.engine import EngineConfig
    return str(EngineConfig(device=device).kv_torch_dtype).removeprefix("torch.")


def _kernel_isa() -> str:
    from workers.model.kernels import cpu_kernels
    ext = cpu_kernels()
    if ext is None:
        return "none (torch fallback)"
    isa = ext.isa()
    if isa != "avx512_vnni":
        return isa.upper()
    pairs, patterns = ext.pair_min_rows(), ext.patterns_pay()
    few = "pattern tiles for int8 and AVX2 for int4" if patterns else "AVX2"
    return (f"AVX-512 VNNI: pair tiles (16 channels per activation broadcast) from {pairs} "
            f"row{'s' if pairs > 1 else ''}, else {few}" if pairs
            else "AVX-512 VNNI for int8 at small batch, AVX2 otherwise" if patterns else "AVX2")


def _version(package: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = _args(argv)
    started, env = time.time(), environment()
    gguf = resolve_model().gguf_path
    mode_results = []
    ref = None
    if args.kl_tokens and args.ppl_tokens:
        print("[bench-engine] fp32 reference logits ...", flush=True)
        ref = ours.reference(gguf, min(args.kl_tokens, args.ppl_tokens))
    print("[bench-engine] roofline: read bandwidth, GEMM peaks ...", flush=True)
    torch.set_num_threads(args.threads)
    roof = roofline.measure()
    for mode in args.modes:
        print(f"[bench-engine] ours {mode} ...", flush=True)
        mode_results.append(ours.run_mode(
            gguf, mode, device=args.device, threads=args.threads, concurrency=args.concurrency,
            prompt_len=args.prompt_len, new_tokens=args.new_tokens, ppl_tokens=args.ppl_tokens,
            repeats=args.repeats, ref=ref))
    for mode in args.quality_modes if args.ppl_tokens else []:   # --ppl-tokens 0: none
        print(f"[bench-engine] ours {mode} (perplexity and bytes only) ...", flush=True)
        mode_results.append(ours.quality_only(gguf, mode, device=args.device,
                                              threads=args.threads, ppl_tokens=args.ppl_tokens,
                                              ref=ref))
    # Measured again after our cells: a host's rates drift within a run, and a bound taken in
    # a slow moment could be passed (a prefill cell once reached 103% of it).
    print("[bench-engine] roofline again ...", flush=True)
    measured = (roof, roofline.measure())
    roof = roofline.best_of(*measured)
    print("[bench-engine] peers ...", flush=True)
    peer_results = [] if args.skip_peers else _run_peers(args, gguf)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_report(out, _header(args, argv, started, env), mode_results, peer_results,
                 args.concurrency, verdicts(mode_results, peer_results, args.concurrency), roof,
                 measured)
    print(out.read_text())


if __name__ == "__main__":
    main()
