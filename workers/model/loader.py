"""Builds a ready LlamaForCausalLM: from a GGUF file, or with random weights for unit tests."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from workers.model.config import ModelConfig
from workers.model.gguf_loader import config_from_gguf, load_llama_weights, read_gguf
from workers.model.llama import LlamaForCausalLM


def load_model(gguf_path: str, *, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Dequantize every GGUF tensor and return the model in eval mode on `device` in `dtype`."""
    gguf = read_gguf(gguf_path)
    config = config_from_gguf(gguf)
    model = LlamaForCausalLM(config, device=device, dtype=dtype)
    with _single_cpu_thread():
        load_llama_weights(gguf, model)
    return model.eval(), config


@contextmanager
def _single_cpu_thread() -> Iterator[None]:
    """Dequantization is many small memory-bound ops: one thread loads SmolLM2 in ~1.2 s, while
    two OpenMP threads on a busy 2-core host spun for 10-20 s. Start-up only; restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def build_random_model(config: ModelConfig, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32, seed: int = 0) -> LlamaForCausalLM:
    """A model whose weights are a pure function of `seed`, scaled so activations stay O(1).

    Weights are drawn on the CPU with a private generator, so the same seed gives the same model
    on every device and leaves the global RNG untouched.
    """
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config, device=device, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # Norm gains near 1, but not exactly, so a wrong norm placement shows in outputs.
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
            else:
                values = torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5
            param.copy_(values)
    return model.eval()
