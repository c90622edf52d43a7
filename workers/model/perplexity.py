"""Perplexity on a fixed English text, to compare weight modes (the same text every run).

The text is the "Execution model" chapter of the Python 3.11 language reference (from the
standard library's pydoc_data; PSF documentation licence), shipped beside this file so the score
cannot drift with the interpreter's patch version.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from workers.model.llama import LlamaForCausalLM

TEXT_PATH = Path(__file__).resolve().parent / "perplexity_text.txt"


def evaluation_text() -> str:
    return TEXT_PATH.read_text(encoding="utf-8")


@torch.inference_mode()
def perplexity(model: LlamaForCausalLM, token_ids: list[int], window: int = 512) -> float:
    """exp(mean NLL) over non-overlapping windows, each scored from its own start (no carry-over),
    through the model's reference causal path so no KV cache is needed."""
    device = model.embed_tokens.device
    total_nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        ids = torch.tensor(chunk[:-1], device=device)
        hidden = model(ids, torch.arange(len(ids), device=device))
        logprobs = torch.log_softmax(model.compute_logits(hidden), dim=-1)
        targets = torch.tensor(chunk[1:], device=device)
        total_nll -= logprobs.gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(total_nll / count)
