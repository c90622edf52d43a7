"""The inference model: llama decoder, paged attention, GGUF loading."""
from workers.model.attention import (AttentionMetadata, allocate_kv_caches,
                                     kv_cache_bytes_per_block)
from workers.model.config import ModelConfig
from workers.model.llama import LlamaForCausalLM
from workers.model.loader import build_random_model, load_model

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "ModelConfig", "allocate_kv_caches",
           "build_random_model", "kv_cache_bytes_per_block", "load_model"]
