"""Projection layers in every weight mode behind one call: `proj(x, norm=, silu_mul=, residual=)`.

Folding the pre-op (RMSNorm or SiLU-and-multiply) and the residual add into the projection call
lets the AVX2 kernels do them in the same pass that quantizes the activations, and cuts the
torch ops per layer from ~40 to ~8: at batch 1 the step is dispatch-bound, not matmul-bound.

Modes: fp32 / bf16 (dense), int8 (per output channel) and int4 (groups of 32, scale + min).
Quantized weights use the packed AVX2 kernels on CPU with fp32 activations; anywhere else
(CUDA, no AVX2, failed build) they are dequantized per call and multiplied with F.linear,
which is correct everywhere and fast nowhere (torchao's kernels are the CUDA upgrade path).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model import quant_formats as qf
from workers.model.kernels import cpu_kernels, dense_prefill_min_rows, pack_amx

QUANTIZATION_MODES = ("fp32", "bf16", "int8", "int4")
_PRE_NONE, _PRE_RMS_NORM, _PRE_SILU_MUL = 0, 1, 2


def fused_kernels(x: torch.Tensor):
    """The CPU kernel module when it applies to activations `x`, else None."""
    # is_cpu, not x.device.type: building a torch.device per call was 4% of a batch-1 step.
    if not x.is_cpu or x.dtype != torch.float32:
        return None
    return cpu_kernels()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ext = fused_kernels(x)
    if ext is not None and x.dim() == 2:
        return ext.rms_norm(x, weight, eps)
    # Normalise in fp32 then scale in the model dtype, exactly as HF's LlamaRMSNorm does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    ext = fused_kernels(x)
    if ext is not None and x.dim() == 2:
        return ext.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class Linear(nn.Module):
    """Dense weight [out, in] as a Parameter (the GGUF loader fills it); fp32 or bf16 storage."""

    def __init__(self, out_features: int, in_features: int, device: torch.device | str,
                 dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        # Uninitialised on purpose: the loader or build_random_model always fills it.
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device,
                                               dtype=dtype), requires_grad=False)

    @property
    def mode(self) -> str:
        return "bf16" if self.weight.dtype == torch.bfloat16 else "fp32"

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor, *, norm: nn.Module | None = None, silu_mul: bool = False,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        h = _pre(x, norm, silu_mul)
        if h.dtype != self.weight.dtype:    # bf16 storage under fp32 activations
            y = F.linear(h.to(self.weight.dtype), self.weight).to(x.dtype)
            return y if residual is None else residual.add_(y)
        if residual is None:
            return F.linear(h, self.weight)
        if residual.dim() == 2:             # one BLAS call with beta = 1, no temporary
            return residual.addmm_(h, self.weight.t())
        return residual.add_(F.linear(h, self.weight))


def _pre(x: torch.Tensor, norm: nn.Module | None, silu: bool) -> torch.Tensor:
    if norm is not None:
        x = norm(x)
    return silu_mul(x) if silu else x


class QuantizedLinear(nn.Module):
    """int8 or int4 weight-only projection; build with `from_weight`."""

    def __init__(self, mode: str, out_features: int, in_features: int, tensors: dict,
                 packed: bool):
        super().__init__()
        self.mode, self.out_features, self.in_features = mode, out_features, in_features
        # Plain attributes, not buffers: model.to(dtype) must never cast packed bytes or scales.
        self.tensors, self.packed = tensors, packed
        # bf16 [N, K] copy of the dequantized weight for the decoder stack's prefill-sized calls
        # on CPUs with a fast bf16 GEMM (kernels.dense_prefill_min_rows).
        self.dense_copy: torch.Tensor | None = None
        # The same copy packed for AMX tiles (kernels.pack_amx), used from `amx_min_rows` rows:
        # set by quantize.quantize_model for the output layer on AMX CPUs (use_amx_copy).
        self.amx_copy: torch.Tensor | None = None
        self.amx_min_rows = 0
        if packed:   # hot-path attributes, resolved once
            self._qgemm = cpu_kernels().qgemm
            self._packed_weight, self._scales = tensors["packed"], tensors["scales"]
            self._int4 = mode == "int4"

    @classmethod
    def from_weight(cls, weight: torch.Tensor, mode: str, device: torch.device | str,
                    pack: bool, prefill_copy: bool = True) -> QuantizedLinear:
        """Quantize a dense [out, in] weight; `pack` selects the AVX2 kernel layout;
        `prefill_copy` allows the bf16 copy the decoder stack's prefill calls read."""
        out_features, in_features = weight.shape
        w = weight.detach().to("cpu", torch.float32)
        if mode == "int8":
            q, scale = qf.quantize_int8(w)
            tensors = ({"packed": qf.pack_int8(q), "scales": qf.pack_int8_scale(scale)} if pack
                       else {"q": q, "scale": scale})
            dense = lambda: qf.dequantize_int8(q, scale, torch.float32)  # noqa: E731
        elif mode == "int4":
            q, scale, low = qf.quantize_int4(w)
            tensors = ({"packed": qf.pack_int4(q), "scales": qf.pack_int4_scales(scale, low)}
                       if pack else {"q": qf.pack_nibbles(q), "scale": scale, "low": low})
            dense = lambda: qf.dequantize_int4(q, scale, low, in_features, torch.float32)  # noqa: E731
        else:
            raise ValueError(f"not a quantized mode: {mode!r}")
        tensors = {name: t.to(device) for name, t in tensors.items()}
        layer = cls(mode, out_features, in_features, tensors, pack)
        if pack and prefill_copy and dense_prefill_min_rows():
            # The quantized values themselves, widened: prefill computes the same model.
            layer.dense_copy = dense().to(torch.bfloat16).contiguous()
        return layer

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def replace_tensors(self, tensors: dict) -> None:
        """The same values in other storage (hugepages.arena): names, shapes and dtypes kept."""
        if {n: (t.shape, t.dtype) for n, t in tensors.items()} != \
                {n: (t.shape, t.dtype) for n, t in self.tensors.items()}:
            raise ValueError("replacement tensors must match the current ones in name, shape "
                             "and dtype")
        self.tensors = tensors
        if self.packed:
            self._packed_weight, self._scales = tensors["packed"], tensors["scales"]

    def copy_bytes(self) -> int:
        """Bytes of the bf16 copies (resident; read only by calls of many rows)."""
        return sum(c.numel() * c.element_size() for c in (self.dense_copy, self.amx_copy)
                   if c is not None)

    def use_amx_copy(self, min_rows: int) -> None:
        """Calls of `min_rows`+ rows go to the AMX tiles on the bf16 copy (made by from_weight),
        packed here in its place; fewer rows keep the packed int8/int4 tiles."""
        self.amx_copy, self.dense_copy = pack_amx(self.dense_copy), None
        self.amx_min_rows = min_rows
        self._qgemm_amx = cpu_kernels().qgemm_amx

    def forward(self, x: torch.Tensor, *, norm: nn.Module | None = None, silu_mul: bool = False,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        if not self.packed or x.dim() != 2 or x.dtype != torch.float32:
            return self._forward_dequantized(x, norm, silu_mul, residual)
        pre, norm_w, eps = _PRE_NONE, None, 0.0
        if norm is not None:
            pre, norm_w, eps = _PRE_RMS_NORM, norm.weight, norm.eps
        elif silu_mul:
            pre = _PRE_SILU_MUL
        if self.amx_copy is not None and x.shape[0] >= self.amx_min_rows:
            return self._qgemm_amx(x if x.stride(-1) == 1 else x.contiguous(), self.amx_copy,
                                   self.out_features, self.in_features, pre, norm_w, eps,
                                   residual, residual is not None)
        # Packing happened only because the kernels loaded (cached module, no per-call lookup).
        return self._qgemm(x if x.stride(-1) == 1 else x.contiguous(), self._packed_weight,
                           self._scales, self.out_features, self.in_features, self._int4, pre,
                           norm_w, eps, residual, residual is not None)

    def _forward_dequantized(self, x, norm, silu, residual) -> torch.Tensor:
        if self.packed:
            raise RuntimeError("packed AVX2 weights need the CPU kernels and fp32 activations")
        t = self.tensors
        if self.mode == "int8":
            weight = qf.dequantize_int8(t["q"], t["scale"], x.dtype)
        else:
            weight = qf.dequantize_int4(qf.unpack_nibbles(t["q"]), t["scale"], t["low"],
                                        self.in_features, x.dtype)
        y = F.linear(_pre(x, norm, silu), weight)
        return y if residual is None else residual.add_(y)


def convert_linear(layer: Linear, mode: str, device: torch.device | str,
                   activation_dtype: torch.dtype, prefill_copy: bool = True) -> nn.Module:
    """The same projection with its weight stored in `mode` on `device` (prefill_copy: see
    QuantizedLinear.from_weight)."""
    if mode in ("fp32", "bf16"):
        layer.weight.data = layer.weight.data.to(
            device, torch.float32 if mode == "fp32" else torch.bfloat16)
        return layer
    pack = (torch.device(device).type == "cpu" and activation_dtype == torch.float32
            and cpu_kernels() is not None)
    return QuantizedLinear.from_weight(layer.weight, mode, device, pack, prefill_copy)
