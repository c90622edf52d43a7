"""Paged attention over a block-table KV cache, in plain torch so CPU and CUDA share one code path.

The engine describes a batch with `AttentionMetadata`; the model turns it once per forward into an
`AttentionPlan` (host-side loop bounds, masks, gathered block tables) that all layers reuse.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.model import hugepages
from workers.model.config import ModelConfig


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # int64 [T]: cache slot of each new token
    #                                 (block_id * block_size + offset within the block)
    query_start_loc: torch.Tensor   # int64 [B+1]: cumulative query lengths
    seq_lens: torch.Tensor          # int64 [B]: context length of seq b INCLUDING its new tokens
    block_tables: torch.Tensor      # int64 [B, max_blocks_per_seq], padded with 0
    max_seq_len: int
    max_query_len: int              # 1 => pure decode batch (fast path)


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int,
                       device: torch.device | str, dtype: torch.dtype) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per layer (0 = K, 1 = V).

    Zero-filled, not empty: padded block-table entries gather block 0 and are masked out, but a
    masked NaN still poisons the softmax-weighted sum (0 * NaN = NaN). On the CPU all layers'
    tensors are views of one buffer on huge pages where the kernel offers them (hugepages.py).
    """
    shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    if torch.device(device).type == "cpu":
        return list(hugepages.zeros((config.num_layers, *shape), dtype).unbind(0))
    return [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]


KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                   "bfloat16": torch.bfloat16}


def resolve_kv_cache_dtype(setting: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type. "auto": the activations' dtype. "float16" under fp32
    activations on the CPU holds twice the tokens in the same memory (the kernels widen it to
    fp32 as they load, so attention still computes in fp32); it is not the default because it
    bought no speed where measured (a 2-core Zen 4: decode attention over 32 x 196 keys x 30
    layers 17.9-19.9 ms fp32, 16.5-19.9 ms fp16; the loops are bound by latency, not bytes) and
    rounds K and V: SmolLM2-135M int4 over 513 tokens decoded one at a time, KL 0.0038
    nats/token against an fp32 cache, top-1 agreement 97.1%, perplexity 18.53 -> 18.42; 4 of 8
    greedy 48-token continuations identical."""
    if setting == "auto":
        return dtype
    try:
        return KV_CACHE_DTYPES[setting]
    except KeyError:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(KV_CACHE_DTYPES)}, "
                         f"got {setting!r}") from None


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_bytes = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * config.num_kv_heads * config.head_dim * element_bytes
    return per_layer * config.num_layers


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """One sequence whose query is longer than one token (a prompt chunk)."""
    token_start: int
    token_end: int
    seq_len: int
    block_ids: torch.Tensor         # [num_blocks] blocks holding its whole context
    causal_mask: torch.Tensor | None  # [qlen, seq_len] bool; None => no earlier context, is_causal


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    slot_mapping: torch.Tensor
    # Single-token queries, attended to in one batched call.
    decode_token_idx: torch.Tensor | None   # [Bd] token positions in the batch; None => all tokens
    decode_block_tables: torch.Tensor | None  # [Bd, blocks needed by the longest of them]
    decode_mask: torch.Tensor | None        # [Bd, 1, 1, keys] bool, True = attend
    prefills: tuple[PrefillSpan, ...]
    # The fused CPU op's view, every token alike: the block-table row of its sequence and its
    # causal context length (a decode token: the whole sequence).
    block_tables: torch.Tensor              # [B, max_blocks_per_seq]
    token_rows: torch.Tensor                # [T] arange
    token_table_rows: torch.Tensor          # [T]
    token_lens: torch.Tensor                # [T]
    torch_path: bool = True                 # False: the decode_* and prefills fields are unset


def prepare_attention(meta: AttentionMetadata, block_size: int,
                      torch_path: bool = True) -> AttentionPlan:
    """Everything layer-independent, built once per forward instead of once per layer.

    Reads query lengths to the host once (one device sync per step, not per layer).
    `torch_path=False` builds only what the CPU kernels read (the token view): the masks and
    gathered tables of the torch path were ~10 torch calls per step, each slow right after a
    forward has streamed the weights through every cache (~130 us of a 5 ms batch-1 step).
    """
    starts = meta.query_start_loc.tolist()
    query_lens = [end - start for start, end in zip(starts, starts[1:])]
    if not torch_path:
        return AttentionPlan(meta.slot_mapping, None, None, None, (), meta.block_tables,
                             *_token_view(meta, query_lens), torch_path=False)
    seq_lens = meta.seq_lens.tolist()
    decode_rows = [b for b, qlen in enumerate(query_lens) if qlen == 1]
    prefills = tuple(_prefill_span(meta, b, starts[b], starts[b + 1], seq_lens[b], block_size)
                     for b, qlen in enumerate(query_lens) if qlen > 1)
    decode_idx = decode_tables = decode_mask = None
    if decode_rows:
        num_blocks = -(-max(seq_lens[b] for b in decode_rows) // block_size)
        if len(decode_rows) == len(query_lens):   # pure decode: no gathers of metadata rows
            lens, decode_tables = meta.seq_lens, meta.block_tables[:, :num_blocks]
        else:
            rows = torch.tensor(decode_rows, device=meta.block_tables.device)
            lens, decode_tables = meta.seq_lens[rows], meta.block_tables[rows, :num_blocks]
            decode_idx = meta.query_start_loc[rows]
        keys = torch.arange(num_blocks * block_size, device=lens.device)
        decode_mask = (keys[None, :] < lens[:, None])[:, None, None, :]
    return AttentionPlan(meta.slot_mapping, decode_idx, decode_tables, decode_mask, prefills,
                         meta.block_tables, *_token_view(meta, query_lens))


def _token_view(meta: AttentionMetadata, query_lens: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    device = meta.seq_lens.device
    num_tokens = sum(query_lens)
    rows = torch.arange(num_tokens, device=device)
    if num_tokens == len(query_lens):       # pure decode
        return rows, rows, meta.seq_lens
    seq_ids = torch.repeat_interleave(torch.arange(len(query_lens), device=device),
                                      torch.tensor(query_lens, device=device))
    # Token t of sequence b sees everything up to itself: seq_len minus the tokens after it.
    last = meta.query_start_loc[1:][seq_ids] - 1
    return rows, seq_ids, meta.seq_lens[seq_ids] - (last - rows)


def _prefill_span(meta: AttentionMetadata, b: int, start: int, end: int, seq_len: int,
                  block_size: int) -> PrefillSpan:
    qlen = end - start
    num_blocks = -(-seq_len // block_size)
    mask = None
    if seq_len > qlen:
        # Query i sits at position seq_len - qlen + i and sees every key up to and including it.
        device = meta.block_tables.device
        query_pos = torch.arange(seq_len - qlen, seq_len, device=device)
        mask = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]
    return PrefillSpan(start, end, seq_len, meta.block_tables[b, :num_blocks], mask)


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             key: torch.Tensor, value: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim], after RoPE) at their cache slots (in
    the cache's own element type)."""
    _, _, _, kv_heads, head_dim = kv_cache.shape
    kv_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping,
                                                         value.to(kv_cache.dtype))


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """All T tokens as one sequence: [T, H, D] x [T, KVH, D] -> [T, H, D]."""
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
        is_causal=True, enable_gqa=True)
    return out.transpose(0, 1)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """Attention for a mixed batch whose new K/V are already written to `kv_cache`.

    query [T, H, D]; key/value [T, KVH, D] are this step's tokens (reused when a prompt chunk has
    no earlier context, saving a gather). Returns [T, H, D].
    """
    if not plan.torch_path:
        raise ValueError("this plan was prepared for the CPU kernels only (torch_path=False)")
    out = query.new_empty(query.shape) if plan.prefills else None
    if plan.decode_block_tables is not None:
        decode_q = query if plan.decode_token_idx is None else query[plan.decode_token_idx]
        decode_out = _decode_attention(decode_q, kv_cache, plan)
        if out is None:
            return decode_out
        out[plan.decode_token_idx] = decode_out
    for span in plan.prefills:
        out[span.token_start:span.token_end] = _prefill_attention(
            query, key, value, kv_cache, span)
    return out


def fused_paged_attention(ext, qkv: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan,
                          num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The CPU kernels' path: qkv [T, (H + 2 KVH) * D] already rotated and written to the cache.

    Decode and prompt tokens alike in one C++ call that reads K/V in place through the block
    tables: no gather copy, no mask tensor, and no SDPA math fallback (torch's CPU flash kernel
    takes neither GQA nor a mask, so prompt chunks with earlier context ran ~10x slower).
    Returns [T, H * D].
    """
    head_dim = kv_cache.shape[-1]
    out = qkv.new_empty(qkv.shape[0], num_heads * head_dim)
    ext.paged_attention(qkv, plan.token_rows, plan.token_table_rows, plan.token_lens, kv_cache,
                        plan.block_tables, out, num_heads, num_kv_heads, head_dim ** -0.5)
    return out


def _decode_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                      plan: AttentionPlan) -> torch.Tensor:
    """One query token per sequence, all sequences in one SDPA call.

    Grouped-query heads are folded into the query-length axis ([B, KVH, group, D]) so K/V are
    read once per KV head instead of being repeated for every query head.
    """
    batch, num_heads, head_dim = query.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    num_keys = plan.decode_block_tables.shape[1] * block_size
    # One index_select for K and V together: ~4x faster on CPU than two advanced-index gathers.
    kv = kv_cache.index_select(1, plan.decode_block_tables.flatten()).to(query.dtype)
    kv = kv.view(2, batch, num_keys, kv_heads, head_dim).transpose(2, 3)   # [2, B, KVH, keys, D]
    keys, values = kv[0], kv[1]
    grouped_q = query.view(batch, kv_heads, num_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=plan.decode_mask)
    return out.reshape(batch, num_heads, head_dim)


def _prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
    q = query[span.token_start:span.token_end].transpose(0, 1)           # [H, qlen, D]
    if span.causal_mask is None:
        k = key[span.token_start:span.token_end].transpose(0, 1)
        v = value[span.token_start:span.token_end].transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(0, 1)
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    num_keys = span.block_ids.shape[0] * block_size
    kv = kv_cache.index_select(1, span.block_ids).to(q.dtype).view(2, num_keys, kv_heads,
                                                                    head_dim)
    k, v = kv[0, :span.seq_len], kv[1, :span.seq_len]
    out = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=span.causal_mask, enable_gqa=True)
    return out.transpose(0, 1)
