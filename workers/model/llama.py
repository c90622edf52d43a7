"""Llama-architecture decoder (SmolLM2, Llama 2/3 without rope scaling) over a paged KV cache.

Weights use the Hugging Face layout (rotate-half RoPE); gguf_loader undoes llama.cpp's Q/K row
permutation. Projections are fused (qkv, gate_up): four matmuls per layer instead of seven, which
is fewer dispatches on CPU and fewer kernel launches on CUDA for the same bytes read. Each
projection also takes its RMSNorm / SiLU pre-op and residual add (see linear.py), and on CPU
RoPE + KV write and paged attention are one C++ call each: a layer is ~8 calls, not ~40. With
int8/int4 weights packed for the CPU kernels the whole stack is one C++ call (decoder_stack).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.attention import (AttentionMetadata, AttentionPlan, causal_attention,
                                     fused_paged_attention, paged_attention, prepare_attention,
                                     write_kv)
from workers.model.config import ModelConfig
from workers.model.linear import Linear, fused_kernels, rms_norm

# KV caches the CPU kernels read and write (fp16 widened to fp32 as it loads).
_KERNEL_KV_DTYPES = (torch.float32, torch.float16)


def _param(*shape: int, device: torch.device | str, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised on purpose: a loader or build_random_model always fills every parameter, and
    # skipping nn.Linear's init saves ~1 s on a 135M model.
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device: torch.device | str, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = _param(size, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rope(NamedTuple):
    """One forward's rotary inputs: positions and the full tables (for the fused CPU op), and
    [T, 1, D/2] per-token tables in the compute dtype (for the torch path), shared by all layers."""
    positions: torch.Tensor
    table_cos: torch.Tensor
    table_sin: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding:
    """cos/sin tables in fp32, built on the model's device.

    Not buffers, so casting the model to bf16 cannot round them; positions index them directly.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str):
        dim = config.head_dim
        # Same expression as HF's default rope init, so the fp32 tables agree with the reference.
        exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        inv_freq = 1.0 / (config.rope_theta ** exponent)
        positions = torch.arange(config.max_position_embeddings, device=device).float()
        freqs = torch.outer(positions, inv_freq)
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return Rope(positions, self.cos, self.sin, self.cos[positions, None].to(dtype),
                    self.sin[positions, None].to(dtype))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [T, heads, D]: pairs are (i, i + D/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = Linear(qkv_rows, config.hidden_size, device, dtype)
        self.o_proj = Linear(config.hidden_size, config.num_heads * config.head_dim, device, dtype)

    def forward(self, x: torch.Tensor, norm: RMSNorm, rope: Rope, kv_cache: torch.Tensor | None,
                plan: AttentionPlan | None) -> torch.Tensor:
        """x + attention(norm(x)); x is updated in place where the projection allows it."""
        qkv = self.qkv_proj(x, norm=norm)
        ext = fused_kernels(qkv)
        if kv_cache is not None and ext is not None and kv_cache.dtype in _KERNEL_KV_DTYPES:
            ext.rope_write_kv(qkv, rope.positions, rope.table_cos, rope.table_sin, kv_cache,
                              plan.slot_mapping, self.num_heads, self.num_kv_heads)
            out = fused_paged_attention(ext, qkv, kv_cache, plan, self.num_heads,
                                        self.num_kv_heads)
        else:
            out = self._torch_attention(qkv, rope, kv_cache, plan)
        return self.o_proj(out, residual=x)

    def _torch_attention(self, qkv: torch.Tensor, rope: Rope, kv_cache: torch.Tensor | None,
                         plan: AttentionPlan | None) -> torch.Tensor:
        num_tokens = qkv.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), rope.cos, rope.sin)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), rope.cos, rope.sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if kv_cache is None:
            out = causal_attention(q, k, v)
        else:
            write_kv(kv_cache, plan.slot_mapping, k, v)
            out = paged_attention(q, k, v, kv_cache, plan)
        return out.reshape(num_tokens, q_size)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = Linear(2 * config.intermediate_size, config.hidden_size, device, dtype)
        self.down_proj = Linear(config.hidden_size, config.intermediate_size, device, dtype)

    def forward(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """x + mlp(norm(x)), in place where the projection allows it."""
        return self.down_proj(self.gate_up_proj(x, norm=norm), silu_mul=True, residual=x)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = LlamaAttention(config, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                                device, dtype)
        self.mlp = LlamaMLP(config, device, dtype)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor | None,
                plan: AttentionPlan | None) -> torch.Tensor:
        x = self.self_attn(x, self.input_layernorm, rope, kv_cache, plan)
        return self.mlp(x, self.post_attention_layernorm)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.embed_tokens = _param(config.vocab_size, config.hidden_size,
                                   device=device, dtype=dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, device, dtype)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        # Tied models have no lm_head until a weight mode other than the activations' dtype
        # gives the output layer its own (quantized) copy; the lookup table stays exact.
        self.lm_head = (None if config.tie_word_embeddings else
                        Linear(config.vocab_size, config.hidden_size, device, dtype))
        self.rotary = RotaryEmbedding(config, device)
        # Set by quantize_model when every projection is packed for the CPU kernels: the whole
        # stack in one C++ call (kernels/decoder_stack.cpp); None runs the layers from Python.
        self.decoder_stack = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor] | None = None,
                attn_metadata: AttentionMetadata | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm.

        kv_caches None: the T tokens are one sequence attended causally (reference path).
        """
        if (kv_caches is None) != (attn_metadata is None):
            raise ValueError("pass kv_caches and attn_metadata together, or neither")
        plan = None
        if kv_caches is not None:
            if len(kv_caches) != len(self.layers):
                raise ValueError(f"expected {len(self.layers)} KV caches, got {len(kv_caches)}")
            # Every layer takes the kernels' attention (LlamaAttention.forward's test) when the
            # activations are CPU fp32 and the cache's dtype is one they read.
            kernels = (kv_caches[0].dtype in _KERNEL_KV_DTYPES
                       and fused_kernels(self.embed_tokens) is not None)
            plan = prepare_attention(attn_metadata, block_size=kv_caches[0].shape[2],
                                     torch_path=not kernels)
        if (plan is not None and self.decoder_stack is not None
                and self.embed_tokens.dtype == torch.float32
                and kv_caches[0].dtype in _KERNEL_KV_DTYPES):
            # Embedding lookup, layers and final norm in one C++ call (forward_ids).
            if input_ids.dtype != torch.int64 or not input_ids.is_contiguous():
                input_ids = input_ids.to(torch.int64).contiguous()
            return self.decoder_stack.forward_ids(
                input_ids, self.embed_tokens, self.norm.weight, positions, self.rotary.cos,
                self.rotary.sin, kv_caches, plan.slot_mapping, plan.token_rows,
                plan.token_table_rows, plan.token_lens, plan.block_tables)
        x = F.embedding(input_ids, self.embed_tokens)
        rope = self.rotary.lookup(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, None if kv_caches is None else kv_caches[i], plan)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = (F.linear(hidden, self.embed_tokens) if self.lm_head is None
                  else self.lm_head(hidden))
        # No .float() call when they already are (a dispatch, ~20 us right after a forward).
        return logits if logits.dtype == torch.float32 else logits.float()
