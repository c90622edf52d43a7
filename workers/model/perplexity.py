"""Quality of a weight mode on a fixed English text: perplexity, and how far its next-token
distributions sit from the fp32 reference's (KL divergence, top-1 agreement) on the decode path.

The text is the "Execution model" chapter of the Python 3.11 language reference (from the
standard library's pydoc_data; PSF documentation licence), shipped beside this file so the score
cannot drift with the interpreter's patch version.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from workers.model.attention import AttentionMetadata, allocate_kv_caches
from workers.model.llama import LlamaForCausalLM

TEXT_PATH = Path(__file__).resolve().parent / "perplexity_text.txt"


def evaluation_text() -> str:
    return TEXT_PATH.read_text(encoding="utf-8")


def _one_sequence(start: int, end: int, block_size: int, device) -> AttentionMetadata:
    """Rows [start, end) of one sequence whose KV cache fills blocks 0, 1, 2, ... in order."""
    t = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
    num_blocks = -(-end // block_size)
    return AttentionMetadata(
        slot_mapping=torch.arange(start, end, device=device), query_start_loc=t([0, end - start]),
        seq_lens=t([end]), block_tables=t([list(range(num_blocks))]), max_seq_len=end,
        max_query_len=end - start)


@torch.inference_mode()
def perplexity(model: LlamaForCausalLM, token_ids: list[int], window: int = 512,
               paged: bool = False) -> float:
    """exp(mean NLL) over non-overlapping windows, each scored from its own start (no carry-over).

    paged=False: the model's reference causal path (no KV cache). paged=True: the serving path
    (a paged KV cache, and with it the fused C++ decoder stack and its prefill GEMMs when the
    model has them), i.e. what a worker computes for a prompt."""
    device = model.embed_tokens.device
    caches, block_size = None, 16
    if paged:
        caches = allocate_kv_caches(model.config, -(-window // block_size), block_size, device,
                                    model.embed_tokens.dtype)
    total_nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        ids = torch.tensor(chunk[:-1], device=device)
        positions = torch.arange(len(ids), device=device)
        if paged:
            hidden = model(ids, positions, caches, _one_sequence(0, len(ids), block_size, device))
        else:
            hidden = model(ids, positions)
        logprobs = torch.log_softmax(model.compute_logits(hidden), dim=-1)
        targets = torch.tensor(chunk[1:], device=device)
        total_nll -= logprobs.gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(total_nll / count)


@torch.inference_mode()
def reference_logprobs(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """[T, vocab] log-probabilities of the next token after each of `token_ids`, from the
    model's reference causal path in one pass (no KV cache)."""
    device = model.embed_tokens.device
    hidden = model(torch.tensor(token_ids, device=device),
                   torch.arange(len(token_ids), device=device))
    return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1).cpu()


@torch.inference_mode()
def decode_logprobs(model: LlamaForCausalLM, token_ids: list[int], block_size: int = 16
                    ) -> torch.Tensor:
    """The same [T, vocab] log-probabilities, computed the way a worker decodes: one token per
    step through the paged KV cache (teacher-forced), so every projection runs at batch 1; for
    int8/int4 on a CPU that means the kernels' int8-quantized activations, never prefill's bf16
    path."""
    device = model.embed_tokens.device
    num_blocks = -(-len(token_ids) // block_size)
    caches = allocate_kv_caches(model.config, num_blocks, block_size, device,
                                model.embed_tokens.dtype)
    rows = []
    for position, token in enumerate(token_ids):
        hidden = model(torch.tensor([token], device=device),
                       torch.tensor([position], device=device), caches,
                       _one_sequence(position, position + 1, block_size, device))
        rows.append(model.compute_logits(hidden).float())
    return torch.log_softmax(torch.cat(rows), dim=-1).cpu()


def divergence(reference: torch.Tensor, logprobs: torch.Tensor) -> tuple[float, float]:
    """(mean KL(reference || logprobs) in nats per token, share of positions whose most likely
    token is the reference's): llama.cpp's `perplexity --kl-divergence` measures, which see a
    mode's damage where perplexity on one text can hide it."""
    kl = (reference.exp() * (reference - logprobs)).sum(dim=-1)
    top1 = (reference.argmax(dim=-1) == logprobs.argmax(dim=-1)).float()
    return kl.mean().item(), top1.mean().item()
