"""Reads a llama-architecture GGUF: its config, and its tensors dequantized into our layout.

Common block types are dequantized with vectorised torch ops over the memory-mapped file (the
135M SmolLM2 Q4_1 loads in ~1 s); other types fall back to `gguf.quants.dequantize`.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from llmmesh.tokenizer import read_gguf_metadata
from workers.model.config import ModelConfig

GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_BF16 = 0, 1, 2, 3, 8, 30
# ggml type -> (elements per block, bytes per block) for the types decoded here
_BLOCK_LAYOUT = {GGML_F32: (1, 4), GGML_F16: (1, 2), GGML_BF16: (1, 2),
                 GGML_Q4_0: (32, 18), GGML_Q4_1: (32, 20), GGML_Q8_0: (32, 34)}
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # torch order (ggml lists the fastest-moving dimension first)
    ggml_type: int
    offset: int              # absolute byte offset in the file


@dataclass(frozen=True, slots=True)
class GGUFFile:
    path: str
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]


def read_gguf(path: str) -> GGUFFile:
    header = read_gguf_metadata(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos, entries = header.tensor_table_offset, []
        for _ in range(header.tensor_count):
            (name_len,) = struct.unpack_from("<Q", buf, pos)
            name = buf[pos + 8:pos + 8 + name_len].decode()
            pos += 8 + name_len
            (num_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{num_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * num_dims)
            pos += 4 + 8 * num_dims + 12
            entries.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = int(header.values.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-pos // alignment) * alignment
    tensors = {name: TensorInfo(name, shape, ggml_type, data_start + offset)
               for name, shape, ggml_type, offset in entries}
    return GGUFFile(path, header.values, tensors)


def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    meta = gguf.metadata
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"architecture {arch!r} is not supported (only llama)")
    hidden, num_heads = int(meta["llama.embedding_length"]), int(meta["llama.attention.head_count"])
    head_dim = int(meta.get("llama.attention.key_length", hidden // num_heads))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim or "llama.rope.scaling.type" in meta:
        raise ValueError("partial or scaled rotary embeddings are not supported")
    vocab = int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"])))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_layers=int(meta["llama.block_count"]), num_heads=num_heads,
        num_kv_heads=int(meta.get("llama.attention.head_count_kv", num_heads)),
        head_dim=head_dim, rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(meta["llama.context_length"]),
        # llama.cpp writes no output.weight when the LM head is the embedding matrix.
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=int(meta["tokenizer.ggml.eos_token_id"]))


def weight_sources(config: ModelConfig) -> dict[str, list[tuple[str, int | None]]]:
    """Our parameter name -> the GGUF tensors stacked (by rows) into it, with the head count
    whose rotary permutation must be undone (None: stored as is)."""
    sources: dict[str, list[tuple[str, int | None]]] = {
        "embed_tokens": [("token_embd.weight", None)],
        "norm.weight": [("output_norm.weight", None)]}
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = [("output.weight", None)]
    for i in range(config.num_layers):
        src, dst = f"blk.{i}.", f"layers.{i}."
        sources[dst + "self_attn.qkv_proj.weight"] = [(src + "attn_q.weight", config.num_heads),
                                               (src + "attn_k.weight", config.num_kv_heads),
                                               (src + "attn_v.weight", None)]
        sources[dst + "self_attn.o_proj.weight"] = [(src + "attn_output.weight", None)]
        sources[dst + "mlp.gate_up_proj.weight"] = [(src + "ffn_gate.weight", None),
                                             (src + "ffn_up.weight", None)]
        sources[dst + "mlp.down_proj.weight"] = [(src + "ffn_down.weight", None)]
        sources[dst + "input_layernorm.weight"] = [(src + "attn_norm.weight", None)]
        sources[dst + "post_attention_layernorm.weight"] = [(src + "ffn_norm.weight", None)]
    return sources


def load_llama_weights(gguf: GGUFFile, model: torch.nn.Module) -> None:
    """Dequantize every GGUF tensor straight into the model's (uninitialised) parameters.

    In place and in bounded chunks: no second model-sized copy exists at any point (peak = the
    model + an 8 MiB scratch), and Q/K rows are un-permuted while still quantized (8x fewer bytes).
    """
    # Copy-on-write map: torch.from_numpy needs a writable array, and nothing writes back.
    file_map = np.memmap(gguf.path, dtype=np.uint8, mode="c")
    params = dict(model.named_parameters())
    sources = weight_sources(model.config)
    if params.keys() != sources.keys():
        raise ValueError(f"model parameters and GGUF mapping differ: "
                         f"{sorted(params.keys() ^ sources.keys())[:5]}")
    decoder = _ChunkedDequantizer()
    with torch.no_grad():
        for name, param in params.items():
            dest = param.view(-1, param.shape[-1])
            row = 0
            for tensor_name, rotary_heads in sources[name]:
                info = gguf.tensors[tensor_name]
                if info.shape[-1] != dest.shape[1]:
                    raise ValueError(f"{tensor_name} {info.shape} does not fit "
                                     f"{name} {tuple(param.shape)}")
                raw = _raw_rows(info, file_map)
                if rotary_heads is not None:
                    raw = unpermute_rotary(raw, rotary_heads)
                decoder.decode_into(raw, info, dest[row:row + raw.shape[0]])
                row += raw.shape[0]
            if row != dest.shape[0]:
                raise ValueError(f"{name}: GGUF supplies {row} rows, model has {dest.shape[0]}")


def _raw_rows(info: TensorInfo, file_map: np.ndarray) -> torch.Tensor:
    """The tensor's bytes as uint8 [rows, bytes per row] (zero-copy view of the file)."""
    rows, cols = int(np.prod(info.shape[:-1])), info.shape[-1]
    block_elements, block_bytes = _layout(info.ggml_type)
    row_bytes = cols // block_elements * block_bytes
    raw = file_map[info.offset:info.offset + rows * row_bytes]
    return torch.from_numpy(raw).view(rows, row_bytes)


def _layout(ggml_type: int) -> tuple[int, int]:
    if ggml_type in _BLOCK_LAYOUT:
        return _BLOCK_LAYOUT[ggml_type]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time Q/K row permutation (works on raw quantized rows too).

    llama.cpp rotates interleaved pairs (2i, 2i+1), so its converter reorders each head's rows from
    HF's rotate-half layout (i, i + D/2) into pairs; restoring HF's order lets our RoPE, our KV
    cache and any HF reference agree.
    """
    rows, cols = weight.shape
    return (weight.view(num_heads, rows // num_heads // 2, 2, cols)
            .transpose(1, 2).reshape(rows, cols))


class _ChunkedDequantizer:
    """Decodes block-quantized rows into a destination, a bounded number of blocks at a time."""

    _CHUNK_BLOCKS = 1 << 16   # 2M values: an 8 MiB fp32 scratch, reused across tensors

    def __init__(self) -> None:
        self._scratch: torch.Tensor | None = None

    def decode_into(self, raw: torch.Tensor, info: TensorInfo, dest: torch.Tensor) -> None:
        if info.ggml_type not in _BLOCK_LAYOUT:
            dest.copy_(_dequantize_with_gguf(raw, info.ggml_type).view(dest.shape))
            return
        if info.ggml_type in (GGML_F32, GGML_F16, GGML_BF16):
            dtype = {GGML_F32: torch.float32, GGML_F16: torch.float16}.get(info.ggml_type,
                                                                          torch.bfloat16)
            dest.copy_(raw.to(dest.device).view(dtype).view(dest.shape))
            return
        block_elements, block_bytes = _BLOCK_LAYOUT[info.ggml_type]
        blocks = raw.reshape(-1, block_bytes)
        out = dest.view(-1, block_elements)
        for start in range(0, blocks.shape[0], self._CHUNK_BLOCKS):
            chunk = blocks[start:start + self._CHUNK_BLOCKS].to(dest.device)
            target = out[start:start + chunk.shape[0]]
            work = target if target.dtype == torch.float32 else self._work(chunk.shape[0], dest)
            _dequantize_blocks(chunk, info.ggml_type, work)
            if work is not target:
                target.copy_(work)

    def _work(self, num_blocks: int, dest: torch.Tensor) -> torch.Tensor:
        if self._scratch is None or self._scratch.device != dest.device:
            self._scratch = torch.empty(self._CHUNK_BLOCKS, 32, device=dest.device)
        return self._scratch[:num_blocks]


def _dequantize_blocks(blocks: torch.Tensor, ggml_type: int, out: torch.Tensor) -> None:
    """blocks uint8 [N, block_bytes] -> out fp32 [N, 32], in place."""
    scale = blocks[:, :2].contiguous().view(torch.float16).float()        # [N, 1]
    if ggml_type == GGML_Q8_0:
        out.copy_(blocks[:, 2:].view(torch.int8))
        out.mul_(scale)
        return
    packed = blocks[:, 4:] if ggml_type == GGML_Q4_1 else blocks[:, 2:]
    # Each byte holds element j in its low nibble and element j + 16 in its high nibble.
    out[:, :16].copy_(packed & 0x0F)
    out[:, 16:].copy_(packed >> 4)
    if ggml_type == GGML_Q4_1:
        out.mul_(scale).add_(blocks[:, 2:4].contiguous().view(torch.float16).float())
    else:
        out.sub_(8.0).mul_(scale)


def _dequantize_with_gguf(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(raw.cpu().numpy(), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
