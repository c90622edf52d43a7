"""A roofline of this machine, measured in the same run as the engine cells it bounds.

Every rate below is measured before our cells and again after them; the better of the two is kept.

- streaming read: GB/s of a float32 sum over a buffer far larger than the caches, the better of
  one on 4 KiB pages and one on 2 MiB huge pages (where Linux offers them): the packed weights
  lie on huge pages, and on a 2-core Zen 4 a batch-1 weight stream read up to ~25% faster
  there, so a bound from 4 KiB pages alone could be passed;
- int8 GEMM: the faster of our own kernels (int8 and int4 weights, both int8 dot products on
  int8 activations: what every int8/int4 decode step runs, at 128 and 512 rows, where they are
  compute-bound) and torch._int_mm (oneDNN's int8 GEMM, 512 rows). Until 2026-12-04 the bound
  took ours alone, on the word that nothing here was faster: true on the AVX2-only host where
  this was written (torch._int_mm ~2 GOP/s), false on every VNNI or AMX CPU since (Zen 4: 650-770
  against our 400-600; Zen 5: 1,800 against 1,077; AMX Xeon: 1,817 against 347), so the int8
  bound was our own kernel's speed, not the machine's. The table still gives decode against our
  kernels' peak alone, to compare with reports from before;
- fp32 and bf16 GEMM: torch's (oneDNN; bf16 runs on AMX / AVX-512 bf16 where the CPU has them).

A cell's bound: decode at N sequences must stream the weights once per step, read each
sequence's cached K and V rows (every layer's, in the cache's dtype, for the run's mean
context), and do 2·P·N operations (P = the projection and output-layer weights), so a step
takes at least max((weights + N · KV) / read bandwidth, 2·P·N / GEMM peak) — int8 peak for
int4/int8, fp32 peak for fp32; prefill must do 2·P' operations per token (P': the projections;
a prompt's last token alone goes through the output layer) at the fastest GEMM measured.
Attention's arithmetic and every activation's traffic are left out, so every bound is
optimistic and a cell can never pass 100%. (Until 2026-12-04 the decode bound left the KV reads
out too; the table still gives decode @1 against the weights alone.)
"""
from __future__ import annotations

import time
from dataclasses import astuple, dataclass

import torch


@dataclass
class Roofline:
    read_gbs: float
    int8_gops: float       # ours, best of int8/int4 weights at 128 and 512 rows
    fp32_gflops: float
    bf16_gflops: float
    int_mm_gops: float     # torch._int_mm (oneDNN), 512 rows (0: unavailable)

    def int8_peak_gops(self) -> float:
        """This machine's int8 GEMM rate: the faster of ours and oneDNN's."""
        return max(self.int8_gops, self.int_mm_gops)

    def gemm_peak(self, mode: str) -> float:
        """Operations per second a decode step of `mode` can do at best."""
        return 1e9 * (self.fp32_gflops if mode == "fp32" else self.int8_peak_gops())

    def best_gemm(self) -> float:
        return 1e9 * max(self.int8_peak_gops(), self.fp32_gflops, self.bf16_gflops)


def best_of(a: Roofline, b: Roofline) -> Roofline:
    """Each rate at the better of two measurements (before and after the cells)."""
    return Roofline(*(max(x, y) for x, y in zip(astuple(a), astuple(b))))


def decode_bound_tps(roof: Roofline, mode: str, streamed_bytes: int, params: int, n: int,
                     kv_bytes_per_seq: float = 0.0) -> float:
    """Tokens per second a decode step of n sequences cannot beat (each sequence's step reads
    kv_bytes_per_seq of cached K and V)."""
    step_s = max((streamed_bytes + n * kv_bytes_per_seq) / (roof.read_gbs * 1e9),
                 2 * params * n / roof.gemm_peak(mode))
    return n / step_s


def kv_read_per_step(model, cache_dtype: torch.dtype, mean_context: float) -> float:
    """Bytes of K and V one sequence's decode step reads at `mean_context` tokens of context."""
    from workers.model.attention import kv_cache_bytes_per_block
    return kv_cache_bytes_per_block(model.config, 1, cache_dtype) * mean_context


def prefill_bound_tps(roof: Roofline, params: int) -> float:
    return roof.best_gemm() / (2 * params)


def _best_s(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure(read_mib: int = 512, gemm: int = 2048, rows: tuple[int, ...] = (128, 512),
            repeats: int = 5) -> Roofline:
    """Best of `repeats` each (on a shared host the fastest run is the least disturbed)."""
    from workers.model import hugepages
    from workers.model.linear import Linear, convert_linear
    with torch.inference_mode():
        buf = torch.ones(read_mib * 2**20 // 4)
        read_s = _best_s(lambda: buf.sum(), repeats)
        del buf
        buf = hugepages.zeros((read_mib * 2**20 // 4,), torch.float32).fill_(1.0)
        read_s = min(read_s, _best_s(lambda: buf.sum(), repeats))
        del buf
        a = torch.randn(gemm, gemm)
        fp32_s = _best_s(lambda: a @ a, repeats)
        b = a.to(torch.bfloat16)
        bf16_s = _best_s(lambda: b @ b, max(1, repeats // 2))
        int8_gops = 0.0
        for mode in ("int8", "int4"):   # both run int8 dot products on int8 activations
            layer = Linear(gemm, gemm, "cpu", torch.float32)
            layer.weight.data.normal_()
            q = convert_linear(layer, mode, "cpu", torch.float32, prefill_copy=False)
            for m in rows:
                x = torch.randn(m, gemm)
                int8_gops = max(int8_gops, 2 * m * gemm * gemm / _best_s(lambda: q(x), repeats) / 1e9)
        try:
            ai = torch.randint(-127, 127, (rows[-1], gemm), dtype=torch.int8)
            bi = torch.randint(-127, 127, (gemm, gemm), dtype=torch.int8)
            int_mm = 2 * rows[-1] * gemm * gemm / _best_s(lambda: torch._int_mm(ai, bi), repeats) / 1e9
        except (RuntimeError, AttributeError):
            int_mm = 0.0
    return Roofline(read_gbs=read_mib * 2**20 / read_s / 1e9,
                    int8_gops=int8_gops,
                    fp32_gflops=2 * gemm**3 / fp32_s / 1e9, bf16_gflops=2 * gemm**3 / bf16_s / 1e9,
                    int_mm_gops=int_mm)


def linear_params(model) -> tuple[int, int]:
    """(decode, prefill): the weights a decode step multiplies each token by — every projection
    and the output layer — and a prompt token by: the projections (only a sequence's last
    prompt token goes through the output layer)."""
    from workers.model.linear import Linear, QuantizedLinear
    layers = [m for m in model.modules() if isinstance(m, (Linear, QuantizedLinear))]
    params = sum(m.out_features * m.in_features for m in layers)
    if model.lm_head is None:   # tied: the embedding table is the output layer
        return params + model.embed_tokens.numel(), params
    return params, params - model.lm_head.out_features * model.lm_head.in_features


def table(roof: Roofline, modes, concurrency: list[int],
          measured: tuple[Roofline, ...] = ()) -> list[str]:
    """The measured peaks (with each measurement where there were several: a shared host's
    rates move within a run), then every cell of ours as a share of its bound."""
    lines = [f"- streaming read: {roof.read_gbs:.1f} GB/s; int8 GEMM: {roof.int8_peak_gops():.0f} GOP/s, "
             f"the faster of ours (best at 128/512 rows: {roof.int8_gops:.0f}) and torch._int_mm "
             f"({roof.int_mm_gops:.0f}); fp32 GEMM: {roof.fp32_gflops:.0f} GFLOP/s; bf16 GEMM: "
             f"{roof.bf16_gflops:.1f} GFLOP/s", ""]
    if len(measured) > 1:
        lines[-1:-1] = [
            "- each measurement (before our cells, after them): streaming read "
            + " / ".join(f"{m.read_gbs:.1f}" for m in measured) + " GB/s; int8 GEMM ours "
            + " / ".join(f"{m.int8_gops:.0f}" for m in measured) + ", torch._int_mm "
            + " / ".join(f"{m.int_mm_gops:.0f}" for m in measured) + " GOP/s"]
    # Our kernels' own peak, the int8 bound of reports before 2026-12-04 (see the docstring).
    ours_only = Roofline(roof.read_gbs, roof.int8_gops, roof.fp32_gflops, roof.bf16_gflops, 0.0)
    against_ours = []
    head = (["mode"] + [f"decode @{n}" for n in concurrency]
            + [f"prefill @{n}" for n in concurrency])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    alone = []
    for m in modes:
        if not m.decode_tps or not m.linear_params:
            continue
        streamed = m.weight_bytes.get("streamed_per_step", 0)
        cells = []
        for n in concurrency:
            bound = decode_bound_tps(roof, m.mode, streamed, m.linear_params, n,
                                     m.kv_read_per_seq)
            got = m.decode_tps.get(n)
            cells.append("—" if got is None else f"{got:,.0f} of {bound:,.0f} ({100 * got / bound:.0f}%)")
            # Differs only for int8/int4 cells bound by compute where torch._int_mm is faster.
            own = decode_bound_tps(ours_only, m.mode, streamed, m.linear_params, n,
                                   m.kv_read_per_seq)
            if got and own != bound:
                against_ours.append(f"{m.mode} @{n} {100 * got / own:.0f}% of {own:,.0f}")
        if m.kv_read_per_seq and m.decode_tps.get(1):
            weights_only = decode_bound_tps(roof, m.mode, streamed, m.linear_params, 1)
            alone.append(f"{m.mode} {100 * m.decode_tps[1] / weights_only:.0f}% of "
                         f"{weights_only:,.0f} (KV read per step: "
                         f"{m.kv_read_per_seq / 2**20:.1f} MiB)")
        bound = prefill_bound_tps(roof, m.prefill_params)
        for n in concurrency:
            got = m.prefill_tps.get(n)
            cells.append("—" if got is None else f"{got:,.0f} of {bound:,.0f} ({100 * got / bound:.0f}%)")
        lines.append(f"| {m.mode} | " + " | ".join(cells) + " |")
    if alone:
        lines += ["", "Decode @1 against the weights alone (the bound before the KV reads were "
                      "counted): " + "; ".join(alone) + "."]
    if against_ours:
        lines += ["", f"Decode against our kernels' own int8 peak ({roof.int8_gops:.0f} GOP/s, the "
                      "bound of reports before 2026-12-04), where it is lower than the machine's: "
                      + "; ".join(against_ours) + "."]
    return lines
