"""Value objects that leave the engine: per-step request outputs, usage, load, runner results."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RequestUsage:
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    prefill_device_s: float
    decode_device_s: float
    queue_s: float                      # arrival to first admission into the running batch
    num_preemptions: int = 0
    # Wall seconds from first admission to the first token: the prefill as the client waited
    # for it, steps given to other requests meanwhile included (prefill_device_s is its share).
    prefill_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    finished: bool
    finish_reason: str | None = None    # a llmmesh.vocab.FinishReason
    usage: RequestUsage | None = None   # on the final output only
    error: str | None = None            # set with finish_reason ERROR


@dataclass(frozen=True, slots=True)
class EngineLoad:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    # The most recently cached prefix-block hashes, newest first, bounded for the wire.
    cached_block_hashes: tuple[int, ...] = ()
    prefix_cache_hit_rate: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    # Only requests whose whole sequence is computed after the step get a token.
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, float] = field(default_factory=dict)
