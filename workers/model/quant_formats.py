"""Weight quantization formats: int8 per output channel, int4 in groups of 32 with scale and min.

Pure torch, device-agnostic: quantize, dequantize (the reference and the non-AVX2/CUDA path) and
repack into the AVX2 kernels' tile layout (see kernels/qgemm.cpp for the byte order).
"""
from __future__ import annotations

import torch

GROUP_SIZE = 32   # int4 group = the kernels' activation block: one fp32 rescale per 32 products
_TILE_N = 8       # output channels per kernel tile


def _pad(weight: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    n, k = weight.shape
    if (n, k) == (rows, cols):
        return weight
    return torch.nn.functional.pad(weight, (0, cols - k, 0, rows - n))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per output channel: w ~= q * scale, q in [-127, 127]."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(w * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(dtype) * scale.to(dtype)[:, None])


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per group of 32 along K: w ~= q * scale + min, q in [0, 15], scale/min fp16.

    K is zero-padded to a multiple of 32. On a Q4_1 GGUF tensor (the same format) this recovers
    the stored blocks up to fp16 rounding of the scale, so int4 costs almost nothing in accuracy.
    """
    n, k = weight.shape
    groups = _round_up(k, GROUP_SIZE) // GROUP_SIZE
    w = _pad(weight.float(), n, groups * GROUP_SIZE).view(n, groups, GROUP_SIZE)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scale = ((hi - lo) / 15.0).half()
    low = lo.half()
    s, m = scale.float()[..., None], low.float()[..., None]
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))
    q = torch.round((w - m) * inv).clamp_(0, 15).to(torch.uint8)
    return q.view(n, groups * GROUP_SIZE), scale, low


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, k: int,
                    dtype: torch.dtype) -> torch.Tensor:
    n = q.shape[0]
    w = q.view(n, -1, GROUP_SIZE).to(dtype) * scale.to(dtype)[..., None] + low.to(dtype)[..., None]
    return w.view(n, -1)[:, :k]


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, Kp] values in [0, 15] -> [N, Kp / 2] bytes (even k low nibble): the portable layout,
    so the dequantize-per-call path (CUDA, no AVX2) keeps int4's memory saving too."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).view(packed.shape[0], -1)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 -> [N/8, Kp/4, 8, 4]: one 32-byte load = 8 channels x 4 k."""
    n, k = q.shape
    rows, cols = _round_up(n, _TILE_N), _round_up(k, GROUP_SIZE)
    padded = _pad(q, rows, cols)
    return padded.view(rows // 8, 8, cols // 4, 4).permute(0, 2, 1, 3).contiguous()


def pack_int8_scale(scale: torch.Tensor) -> torch.Tensor:
    return _pad(scale.float()[None], 1, _round_up(scale.shape[0], _TILE_N))[0].contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, Kp] uint8 in [0, 15] -> [N/8, Kp/32, 4, 8, 4] bytes: nibble-low k = 8p + j,
    nibble-high k = 8p + 4 + j, so one 32-byte load unpacks to two maddubs operands."""
    n, kp = q.shape
    rows = _round_up(n, _TILE_N)
    t = _pad(q, rows, kp).view(rows // 8, 8, kp // GROUP_SIZE, 4, 2, 4)
    t = t.permute(0, 2, 3, 1, 5, 4)                       # [NB, G, p, n, j, half]
    return (t[..., 0] | (t[..., 1] << 4)).contiguous()


def pack_int4_scales(scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """[N, G] fp16 scale and min -> [N/8, G, 2, 8] fp16 (eight scales, then eight mins)."""
    n, groups = scale.shape
    rows = _round_up(n, _TILE_N)
    both = torch.stack((_pad(scale, rows, groups), _pad(low, rows, groups)))   # [2, N, G]
    return both.view(2, rows // 8, 8, groups).permute(1, 3, 0, 2).contiguous()
