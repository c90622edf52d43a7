"""Llama-architecture decoder (SmolLM2, Llama 2/3 without rope scaling) over a paged KV cache.

Weights use the Hugging Face layout (rotate-half RoPE); gguf_loader undoes llama.cpp's Q/K row
permutation. Projections are fused (qkv, gate_up): three matmuls per layer instead of five, which
is fewer dispatches on CPU and fewer kernel launches on CUDA for the same bytes read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.attention import (AttentionMetadata, AttentionPlan, causal_attention,
                                     paged_attention, prepare_attention, write_kv)
from workers.model.config import ModelConfig


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
        # Normalise in fp32 then scale in the model dtype, exactly as HF's LlamaRMSNorm does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


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

    def lookup(self, positions: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D/2] tables in the compute dtype, shared by every layer of one forward."""
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)


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
        self.qkv_proj = _param(qkv_rows, config.hidden_size, device=device, dtype=dtype)
        self.o_proj = _param(config.hidden_size, config.num_heads * config.head_dim,
                             device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor | None, plan: AttentionPlan | None) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, self.qkv_proj).split((q_size, kv_size, kv_size), dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), *rope)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), *rope)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if kv_cache is None:
            out = causal_attention(q, k, v)
        else:
            write_kv(kv_cache, plan.slot_mapping, k, v)
            out = paged_attention(q, k, v, kv_cache, plan)
        return F.linear(out.reshape(num_tokens, q_size), self.o_proj)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = _param(2 * config.intermediate_size, config.hidden_size,
                                   device=device, dtype=dtype)
        self.down_proj = _param(config.hidden_size, config.intermediate_size,
                                device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device | str, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = LlamaAttention(config, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                                device, dtype)
        self.mlp = LlamaMLP(config, device, dtype)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: torch.Tensor | None, plan: AttentionPlan | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self.lm_head = (None if config.tie_word_embeddings else
                        _param(config.vocab_size, config.hidden_size, device=device, dtype=dtype))
        self.rotary = RotaryEmbedding(config, device)

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
            plan = prepare_attention(attn_metadata, block_size=kv_caches[0].shape[2])
        x = F.embedding(input_ids, self.embed_tokens)
        rope = self.rotary.lookup(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, None if kv_caches is None else kv_caches[i], plan)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(hidden, weight).float()
