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


def load_tensor(gguf: GGUFFile, name: str, file_map: np.ndarray) -> torch.Tensor:
    """One tensor as float32 in torch order."""
    info = gguf.tensors[name]
    num_elements = int(np.prod(info.shape))
    if info.ggml_type not in _BLOCK_LAYOUT:
        return _dequantize_with_gguf(info, file_map)
    block_elements, block_bytes = _BLOCK_LAYOUT[info.ggml_type]
    num_bytes = num_elements // block_elements * block_bytes
    raw = torch.from_numpy(file_map[info.offset:info.offset + num_bytes])
    return _dequantize(raw, info.ggml_type, block_bytes).reshape(info.shape)


def _dequantize(raw: torch.Tensor, ggml_type: int, block_bytes: int) -> torch.Tensor:
    if ggml_type == GGML_F32:
        return raw.view(torch.float32).clone()
    if ggml_type in (GGML_F16, GGML_BF16):
        return raw.view(torch.float16 if ggml_type == GGML_F16 else torch.bfloat16).float()
    blocks = raw.view(-1, block_bytes)
    scale = blocks[:, :2].contiguous().view(torch.float16).float()          # [N, 1]
    if ggml_type == GGML_Q8_0:
        return (blocks[:, 2:].contiguous().view(torch.int8).float() * scale).flatten()
    packed = blocks[:, 4:] if ggml_type == GGML_Q4_1 else blocks[:, 2:]
    # Each byte holds element j in its low nibble and element j + 16 in its high nibble.
    nibbles = torch.cat((packed & 0x0F, packed >> 4), dim=1).float()        # [N, 32]
    if ggml_type == GGML_Q4_1:
        minimum = blocks[:, 2:4].contiguous().view(torch.float16).float()
        return (nibbles * scale + minimum).flatten()
    return ((nibbles - 8.0) * scale).flatten()


def _dequantize_with_gguf(info: TensorInfo, file_map: np.ndarray) -> torch.Tensor:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(info.ggml_type)
    block_elements, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, cols = int(np.prod(info.shape[:-1])), info.shape[-1]
    raw = file_map[info.offset:info.offset + rows * cols // block_elements * block_bytes]
    values = dequantize(raw.reshape(rows, -1), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(info.shape)


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time Q/K row permutation.

    llama.cpp rotates interleaved pairs (2i, 2i+1), so its converter reorders each head's rows from
    HF's rotate-half layout (i, i + D/2) into pairs; we restore HF's order so our RoPE, our KV cache
    and any HF reference agree.
    """
    rows, cols = weight.shape
    return (weight.view(num_heads, rows // num_heads // 2, 2, cols)
            .transpose(1, 2).reshape(rows, cols))


def load_llama_weights(gguf: GGUFFile, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every parameter of LlamaForCausalLM, float32, keyed by our parameter names."""
    # Copy-on-write map: torch.from_numpy needs a writable array, and nothing writes back.
    file_map = np.memmap(gguf.path, dtype=np.uint8, mode="c")

    def get(name: str) -> torch.Tensor:
        return load_tensor(gguf, name, file_map)

    weights = {"embed_tokens": get("token_embd.weight"), "norm.weight": get("output_norm.weight")}
    if not config.tie_word_embeddings:
        weights["lm_head"] = get("output.weight")
    for i in range(config.num_layers):
        src, dst = f"blk.{i}.", f"layers.{i}."
        q = unpermute_rotary(get(src + "attn_q.weight"), config.num_heads)
        k = unpermute_rotary(get(src + "attn_k.weight"), config.num_kv_heads)
        weights[dst + "self_attn.qkv_proj"] = torch.cat((q, k, get(src + "attn_v.weight")))
        weights[dst + "self_attn.o_proj"] = get(src + "attn_output.weight")
        weights[dst + "mlp.gate_up_proj"] = torch.cat((get(src + "ffn_gate.weight"),
                                                       get(src + "ffn_up.weight")))
        weights[dst + "mlp.down_proj"] = get(src + "ffn_down.weight")
        weights[dst + "input_layernorm.weight"] = get(src + "attn_norm.weight")
        weights[dst + "post_attention_layernorm.weight"] = get(src + "ffn_norm.weight")
    return weights
