"""Builds a ready LlamaForCausalLM: from a GGUF file, or with random weights for unit tests."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from workers.model.config import ModelConfig
from workers.model.gguf_loader import config_from_gguf, load_llama_weights, read_gguf
from workers.model.llama import LlamaForCausalLM
from workers.model.quantize import quantize_model, resolve_quantization


def load_model(gguf_path: str, *, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32,
               quantization: str | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Dequantize every GGUF tensor and return the model in eval mode on `device`.

    `dtype` is the activations' (and norms', embeddings') dtype; `quantization` how projection
    weights are stored: fp32 | bf16 | int8 | int4, "auto" for the device's default, None for
    `dtype` itself (a plain dequantized model).
    """
    mode = resolve_quantization(quantization, device, dtype)
    gguf = read_gguf(gguf_path)
    config = config_from_gguf(gguf)
    dense = mode in ("fp32", "bf16") and dtype == (torch.float32 if mode == "fp32"
                                                   else torch.bfloat16)
    # Quantized modes dequantize on the CPU in fp32 first: one full-precision pass, then each
    # projection is requantized from it and the fp32 copy freed.
    build_device, build_dtype = (device, dtype) if dense else ("cpu", torch.float32)
    model = LlamaForCausalLM(config, device=build_device, dtype=build_dtype)
    with _single_cpu_thread():
        load_llama_weights(gguf, model)
        if not dense:
            quantize_model(model, mode, device=device, dtype=dtype)
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
