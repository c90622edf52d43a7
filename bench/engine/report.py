"""bench/results/engine.md and engine.png from one run's results."""
from __future__ import annotations

from pathlib import Path

from bench.engine import roofline
from bench.engine.ours import ModeResult
from bench.engine.peers import PeerResult, winning_build


def _fmt(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _ratio(ours: float | None, peer: float | None) -> str:
    return "—" if not ours or not peer else f"{ours / peer:.2f}×"


def throughput_table(modes: list[ModeResult], peers: list[PeerResult],
                     concurrency: list[int]) -> list[str]:
    head = (["system"] + [f"prefill @{n}" for n in concurrency]
            + [f"decode @{n}" for n in concurrency] + [f"end-to-end @{concurrency[-1]}"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = ([(f"**ours {m.mode}**", m) for m in modes if m.decode_tps]
            + [(p.name, p) for p in peers])
    for name, r in rows:
        cells = ([_fmt(r.prefill_tps.get(n)) for n in concurrency]
                 + [_fmt(r.decode_tps.get(n), 1) for n in concurrency]
                 + [_fmt(r.e2e_tps.get(concurrency[-1]), 1)])
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def build_table(peer: PeerResult, concurrency: list[int]) -> list[str]:
    """Each llama.cpp cell per build and the build whose figure the tables above keep."""
    variants = list(peer.builds)
    lines = ["| cell | " + " | ".join(variants) + " | kept |", "|" + "---|" * (len(variants) + 2)]
    for cell, label, counts, digits in (("prefill_tps", "prefill", concurrency, 0),
                                        ("decode_tps", "decode", concurrency, 1),
                                        ("e2e_tps", "end-to-end", concurrency[-1:], 1)):
        for n in counts:
            kept = winning_build(peer, cell, n)
            if kept is None:
                continue
            values = [_fmt(getattr(peer.builds[v], cell).get(n), digits) for v in variants]
            lines.append(f"| {label} @{n} | " + " | ".join(values) + f" | {kept} |")
    return lines


def ratio_table(modes: list[ModeResult], peers: dict[str, PeerResult],
                concurrency: list[int]) -> list[str]:
    llama, hf32, hf16 = (peers.get(k) for k in ("llama.cpp", "HF transformers fp32",
                                                 "HF transformers bf16"))
    cb = peers.get("HF generate_batch fp32")
    head = (["ours"] + [f"decode @{n} vs llama.cpp" for n in concurrency]
            + [f"decode @{n} vs HF fp32" for n in concurrency]
            + [f"prefill @{n} vs llama.cpp" for n in concurrency]
            + [f"prefill @{concurrency[-1]} vs HF bf16",
               f"e2e @{concurrency[-1]} vs HF generate_batch"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    last = concurrency[-1]
    for m in (m for m in modes if m.decode_tps):
        cells = ([_ratio(m.decode_tps.get(n), llama and llama.decode_tps.get(n))
                  for n in concurrency]
                 + [_ratio(m.decode_tps.get(n), hf32 and hf32.decode_tps.get(n))
                    for n in concurrency]
                 + [_ratio(m.prefill_tps.get(n), llama and llama.prefill_tps.get(n))
                    for n in concurrency]
                 + [_ratio(m.prefill_tps.get(last), hf16 and hf16.prefill_tps.get(last)),
                    _ratio(m.e2e_tps.get(last), cb and cb.e2e_tps.get(last))])
        lines.append(f"| {m.mode} | " + " | ".join(cells) + " |")
    return lines


# Issue 3's figures for llama.cpp on a quiet host of this kind (2 threads, same GGUF/workload).
QUOTED_LLAMACPP = {"prefill": 314.0, "decode": {1: 119.0, 8: 203.0, 32: 242.0}}


def quoted_table(modes: list[ModeResult], concurrency: list[int]) -> list[str]:
    """Ours against the quoted quiet-host llama.cpp: the honest bound when this run's host was
    loaded, since load hurt llama.cpp's batched decode far more than ours."""
    quoted = [n for n in concurrency if n in QUOTED_LLAMACPP["decode"]]
    head = ["ours"] + [f"decode @{n} / {QUOTED_LLAMACPP['decode'][n]:.0f}" for n in quoted]
    head += [f"prefill @1 / {QUOTED_LLAMACPP['prefill']:.0f}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in (m for m in modes if m.decode_tps):
        cells = [_ratio(m.decode_tps.get(n), QUOTED_LLAMACPP["decode"][n]) for n in quoted]
        cells.append(_ratio(m.prefill_tps.get(1), QUOTED_LLAMACPP["prefill"]))
        lines.append(f"| {m.mode} | " + " | ".join(cells) + " |")
    return lines


def quality_table(modes: list[ModeResult]) -> list[str]:
    reference = next((m.perplexity for m in modes if m.mode == "fp32"), None)
    lines = ["| mode | weights streamed per decode step (MiB) | resident weights (MiB) | "
             "perplexity | vs fp32 | KL vs fp32, decode path (nats/token) | top-1 = fp32's | "
             "TTFT uncached (ms) | TTFT 512 cached (ms) | cached/uncached |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m in modes:
        wb = m.weight_bytes
        delta = ("—" if not reference or m.perplexity is None
                 else f"{100 * (m.perplexity / reference - 1):+.2f}%")
        uncached = m.ttft_uncached_s and 1e3 * m.ttft_uncached_s
        cached = m.ttft_cached_s and 1e3 * m.ttft_cached_s
        ttft_ratio = (f"{m.ttft_cached_s / m.ttft_uncached_s:.3f}"
                      if m.ttft_cached_s and m.ttft_uncached_s else "—")
        # KL is >= 0; fp32 against its own reference path rounds to a hair below.
        kl = None if m.kl_vs_fp32 is None else max(m.kl_vs_fp32, 0.0)
        lines.append(
            f"| {m.mode} | {wb.get('streamed_per_step', 0) / 2**20:,.1f} | "
            f"{wb.get('total', 0) / 2**20:,.1f} | "
            f"{_fmt(m.perplexity, 3)} | {delta} | {_fmt(kl, 4)} | "
            f"{'—' if m.top1_vs_fp32 is None else f'{100 * m.top1_vs_fp32:.1f}%'} | "
            f"{_fmt(uncached, 1)} | {_fmt(cached, 1)} | "
            f"{ttft_ratio} |")
    return lines


def plot(path: Path, modes: list[ModeResult], peers: list[PeerResult],
         concurrency: list[int]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = ([(f"ours {m.mode}", m) for m in modes if m.decode_tps]
               + [(p.name, p) for p in peers])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(len(systems), 1)
    for panel, (ax, attr, title) in enumerate(zip(
            axes, ("decode_tps", "prefill_tps"), ("decode tok/s (aggregate)", "prefill tok/s"))):
        for i, (name, r) in enumerate(systems):
            values = [getattr(r, attr).get(n, 0) for n in concurrency]
            xs = [c + i * width for c in range(len(concurrency))]
            ax.bar(xs, values, width, label=name)
        ax.set_xticks([c + width * (len(systems) - 1) / 2 for c in range(len(concurrency))])
        ax.set_xticklabels([f"{n} seq" for n in concurrency])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
        if panel == 0:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _builds(llama: PeerResult | None, concurrency: list[int]) -> list[str]:
    if llama is None or not llama.builds:
        return []
    if len(llama.builds) == 1:
        return ["", f"llama.cpp: every cell from its {next(iter(llama.builds))} build "
                    "(why only one: Notes)."]
    return (["", "## llama.cpp: the build behind each cell (tok/s; best per cell kept)", ""]
            + build_table(llama, concurrency))


def write_report(path: Path, header: list[str], modes: list[ModeResult],
                 peers: list[PeerResult], concurrency: list[int], verdicts: list[str],
                 roof: roofline.Roofline | None = None,
                 measured: tuple[roofline.Roofline, ...] = ()) -> None:
    by_name = {p.name: p for p in peers}
    lines = header + ["", "## Throughput (tok/s, higher is better)", ""]
    lines += throughput_table(modes, peers, concurrency)
    lines += _builds(by_name.get("llama.cpp"), concurrency)
    lines += ["", "## Ours relative to the peers (same run)", ""]
    lines += ratio_table(modes, by_name, concurrency)
    lines += ["", "## Ours relative to llama.cpp as quoted in issue 3 (quiet host, not this run)",
              ""]
    lines += quoted_table(modes, concurrency)
    lines += ["", "## Weights, perplexity, time to first token", "",
              "Perplexity through the serving path's prompt processing (paged KV cache, the fused "
              "decoder stack and, where the CPU has AMX/AVX-512 bf16, its bf16 prefill GEMMs). "
              "KL and top-1 compare each mode's next-token distributions with the fp32 "
              "reference's on the same text decoded one token per step at batch 1 (for int8 "
              "and int4 on a CPU: the kernels' int8-quantized activations, as in every decode "
              "step). Resident weights include the bf16 prefill copies.", ""]
    lines += quality_table(modes)
    if roof is not None:
        lines += ["", "## Roofline: each cell as a share of this machine's bound (same run)", "",
                  "Measured before and after our cells, the better of the two kept "
                  "(bench/engine/roofline.py). Decode @N is bounded by "
                  "max((weights streamed + N · the KV one sequence's step reads) / read "
                  "bandwidth, 2·P·N / GEMM peak), prefill by 2·P per token at the fastest GEMM; "
                  "attention's arithmetic and activations are left out, so the bounds are "
                  "optimistic.", ""]
        lines += roofline.table(roof, modes, concurrency, measured)
    lines += ["", "## Targets (issue 3)", ""] + verdicts
    notes = [f"- {p.name}: {p.note}" for p in peers if p.note]
    if notes:
        lines += ["", "## Notes", ""] + notes
    lines += ["", f"![throughput]({path.with_suffix('.png').name})", ""]
    path.write_text("\n".join(lines))
    plot(path.with_suffix(".png"), modes, peers, concurrency)
