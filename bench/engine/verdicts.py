"""Issue 3's targets checked against one run (first mode listed: the device default)."""
from __future__ import annotations

from bench.engine.ours import ModeResult
from bench.engine.peers import PeerResult


def _check(label: str, value: float | None, target: float, *, at_most: bool = False,
           percent: bool = False) -> str:
    if value is None:
        return f"- {label}: not measured"
    ok = value <= target if at_most else value >= target
    sign = "≤" if at_most else "≥"
    shown, bound = ((f"{100 * value:+.2f}%", f"{100 * target:g}%") if percent
                    else (f"{value:.2f}", f"{target}"))
    return f"- {'PASS' if ok else 'MISS'} {label}: {shown} (target {sign} {bound})"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def verdicts(modes: list[ModeResult], peers: list[PeerResult], concurrency: list[int]
             ) -> list[str]:
    if not modes:
        return ["- no mode measured"]
    m = modes[0]
    by = {p.name: p for p in peers}
    llama, hf32 = by.get("llama.cpp"), by.get("HF transformers fp32")
    hf16, cb = by.get("HF transformers bf16"), by.get("HF generate_batch fp32")
    lines = [f"Checked for `{m.mode}`:"]
    for n, target in ((32, 2.0), (8, 2.0), (1, 1.0)):
        if n in concurrency:
            lines.append(_check(f"decode @{n} / llama.cpp", _ratio(
                m.decode_tps.get(n), llama and llama.decode_tps.get(n)), target))
    for n in concurrency:
        lines.append(_check(f"prefill @{n} / llama.cpp", _ratio(
            m.prefill_tps.get(n), llama and llama.prefill_tps.get(n)), 3.0))
    last = concurrency[-1]
    lines.append(_check(f"prefill @{last} / HF bf16", _ratio(
        m.prefill_tps.get(last), hf16 and hf16.prefill_tps.get(last)), 1.0))
    for n in concurrency:
        lines.append(_check(f"decode @{n} / HF fp32", _ratio(
            m.decode_tps.get(n), hf32 and hf32.decode_tps.get(n)), 1.0))
        lines.append(_check(f"prefill @{n} / HF fp32", _ratio(
            m.prefill_tps.get(n), hf32 and hf32.prefill_tps.get(n)), 1.0))
    lines.append(_check(f"end-to-end @{last} / HF generate_batch", _ratio(
        m.e2e_tps.get(last), cb and cb.e2e_tps.get(last)), 1.0))
    lines.append(_check("TTFT with 512 cached / uncached", _ratio(
        m.ttft_cached_s, m.ttft_uncached_s), 0.2, at_most=True))
    reference = next((r.perplexity for r in modes if r.mode == "fp32"), None)
    for r in modes:
        bound = {"int8": 0.01, "int4": 0.05}.get(r.mode)
        if bound is not None and r.perplexity and reference:
            lines.append(_check(f"perplexity {r.mode} vs fp32", r.perplexity / reference - 1,
                                bound, at_most=True, percent=True))
    return lines
