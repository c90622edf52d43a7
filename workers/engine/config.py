"""Engine configuration (frozen, validated) and the cache facts found at start-up."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.model.attention import resolve_kv_cache_dtype

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Weight storage (workers.model.quantize): "auto" picks per device, "none" means `dtype`.
QUANTIZATIONS = ("auto", "none", "fp32", "bf16", "int8", "int4")
DEFAULT_KV_CACHE_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class EngineConfig:
    gguf_path: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    quantization: str = "auto"
    # The KV cache's element type: "auto" (`dtype`), "float32", "float16" or "bfloat16"
    # (workers.model.attention.resolve_kv_cache_dtype): float16 holds twice the tokens.
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    # Memory budget for the KV cache; num_gpu_blocks, when set, overrides it (tests, benches).
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    num_gpu_blocks: int | None = None
    max_num_seqs: int = 32
    # Tokens processed per step (decodes + prefill chunks): bounds step latency for decodes.
    max_num_batched_tokens: int = 512
    # None: the model's own limit (further capped by what the KV pool can hold).
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # While any interactive request is running or waiting, batch-class work gets at most this
    # many tokens per step, so a step (which cannot be interrupted) stays short and a user's
    # first token is not stuck behind a wide batch step. 0 disables the guard. Batch still gets
    # these tokens every step: slowed, never starved.
    batch_tokens_with_interactive: int = 8
    # Batch-class tokens per step at any time. A step cannot be interrupted, so a wide batch
    # prefill chunk started just before a user's request arrives is what that user waits for;
    # 64 tokens keep such a step short on CPU at a small cost in batch prefill efficiency.
    max_batch_tokens_per_step: int = 64
    # ...and, from a step-time model fitted online (workers/engine/step_cost.py: tokens and
    # KV keys attended), as much as keeps a step with batch work in it within this many
    # milliseconds: what an interactive arrival waits for the step in flight, on any device.
    # None turns the time caps off (the token caps still apply).
    batch_step_budget_ms: float | None = 30.0
    # ...but for `interactive_recent_s` after interactive work was last present (chat traffic
    # comes in sessions), steps holding only batch work are planned within this many ms instead:
    # a chat that arrives mid-step waits for the rest of it, and at 30 ms that wait alone was
    # the whole of the TTFT allowance (1.3x of ~70 ms alone on a 2-core Zen 4). With no user seen
    # for that long, batch takes whole steps again. None: the one budget above at all times.
    batch_step_budget_ms_after_interactive: float | None = 15.0
    interactive_recent_s: float = 10.0
    # While interactive work is present, the predicted time batch work may add to a step (a
    # long-context batch decode reads its whole KV cache: ~90 MB at 2,000 tokens here). The
    # first batch request of every step still advances, so batch is slowed, never starved.
    batch_ms_with_interactive: float = 10.0
    # ...and no more than keeps the step within this factor of the interactive work's own
    # predicted step (its decodes and prefill chunks plus the step's fixed cost): interactive
    # TPOT and TTFT stay within the factor of their unloaded values, learned as the step-time
    # model learns. 0 turns it off (only batch_ms_with_interactive applies).
    interactive_slowdown: float = 1.5
    # The same factor, measured: steps holding interactive work take batch work along only
    # every k-th step, k from the measured step times with and without it (mixed / alone = r:
    # k = ceil((r - 1) / (f - 1))), so interactive time per token averages within f of its
    # unloaded value even where the step-time model misjudges what batch rows cost (a long
    # context row, a prefill chunk). At most this many steps in a row go without batch work:
    # slowed, never starved.
    max_batch_skipped_steps: int = 16
    # Run EngineCore.calibrate() at start-up (warm-up + the step-time model's anchor).
    calibrate: bool = True
    # Nice value of the step thread while a step holds only batch-class work (CPU devices;
    # workers/engine/cpu_priority.py). None or 0: steps always run at the normal priority.
    batch_nice: int | None = 10
    # None leaves torch's default intra-op thread count alone.
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        resolve_kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype)  # raises
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        try:
            torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"device {self.device!r} is not a torch device") from exc
        for name in ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_batch_tokens_per_step <= 0:
            raise ValueError("max_batch_tokens_per_step must be positive")
        if self.batch_tokens_with_interactive < 0:
            raise ValueError("batch_tokens_with_interactive must be >= 0")
        if self.batch_nice is not None and not 0 <= self.batch_nice <= 19:
            raise ValueError("batch_nice must be in [0, 19] when set")
        if self.batch_ms_with_interactive < 0:
            raise ValueError("batch_ms_with_interactive must be >= 0")
        if self.max_batch_skipped_steps < 0:
            raise ValueError("max_batch_skipped_steps must be >= 0")
        if self.interactive_slowdown and self.interactive_slowdown < 1:
            raise ValueError("interactive_slowdown must be >= 1 (or 0: off)")
        if self.batch_step_budget_ms is not None and self.batch_step_budget_ms <= 0:
            raise ValueError("batch_step_budget_ms must be positive when set")
        if (self.batch_step_budget_ms_after_interactive is not None
                and self.batch_step_budget_ms_after_interactive <= 0):
            raise ValueError("batch_step_budget_ms_after_interactive must be positive when set")
        if self.interactive_recent_s < 0:
            raise ValueError("interactive_recent_s must be >= 0")
        for name in ("num_gpu_blocks", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive when set, got {value}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return resolve_kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype)


@dataclass(frozen=True, slots=True)
class CacheInfo:
    """What start-up found: how many KV blocks fit and the longest context they allow."""
    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @staticmethod
    def plan(config: EngineConfig, bytes_per_block: int, model_max_len: int) -> CacheInfo:
        num_blocks = config.num_gpu_blocks or config.kv_cache_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds no block "
                             f"of {bytes_per_block} bytes")
        # A sequence longer than the whole pool could never be scheduled, even alone.
        limits = [model_max_len, num_blocks * config.block_size]
        if config.max_model_len is not None:
            limits.append(config.max_model_len)
        return CacheInfo(num_blocks, config.block_size, bytes_per_block, min(limits))
