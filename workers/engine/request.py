"""The worker's one shared noun: a request, its tokens, counters, block table and block hashes."""
from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence

from llmmesh.prefix_hash import hash_block, root_hash
from llmmesh.vocab import FinishReason, RequestClass

from workers.engine.sampling import SamplingParams

# Breaks arrival-time ties so that scheduling order is total and reproducible.
_arrival_counter = itertools.count()


# One priority per request class, in the class's order: 0 (interactive) is served first.
Priority = enum.IntEnum("Priority", {c.name: c.priority for c in RequestClass})


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
                   RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
                   RequestStatus.FINISHED_ABORTED: FinishReason.CANCELLED}


class Request:
    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "output_logprobs",
                 "_all_token_ids", "sampling_params", "priority", "cache_salt", "block_size",
                 "block_hashes", "block_ids", "num_computed_tokens", "num_cached_tokens",
                 "status", "arrival_time", "arrival_index", "first_scheduled_time",
                 "first_token_time", "tenant", "fair_start", "resumed", "prefill_device_s",
                 "decode_device_s", "num_preemptions")

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling_params: SamplingParams, *, block_size: int,
                 priority: Priority = Priority.INTERACTIVE, cache_salt: str = "",
                 arrival_time: float | None = None, tenant: str = "",
                 resumed: bool = False) -> None:
        self.request_id = request_id
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self._all_token_ids = list(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.priority = Priority(priority)
        self.cache_salt = cache_salt
        self.block_size = block_size
        self.block_hashes: list[int] = []
        self.block_ids: list[int] = []       # block table, written by the KV cache manager
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0           # prefix-cache hit of the first admission
        self.status = RequestStatus.WAITING
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_index = next(_arrival_counter)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.tenant = tenant
        # Start tag in the tenant-fair order of its class (Scheduler.add_request); 0 without a
        # tenant, so tenantless requests keep arrival order.
        self.fair_start = 0.0
        # Continues a completion that another worker broke off: its client already has tokens
        # and waits mid-stream, and its place in line was earned on that worker. It goes ahead
        # of its class's waiting queue.
        self.resumed = resumed
        self.prefill_device_s = 0.0
        self.decode_device_s = 0.0
        self.num_preemptions = 0
        self._extend_block_hashes()

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens. Read-only: append through append_output_token_id."""
        return self._all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def sort_key(self) -> tuple[int, bool, float, float, int]:
        """Scheduling order: interactive before batch, then resumed completions, then
        tenant-fair (start-time fair queueing over tenants), then first come first served."""
        return (self.priority, not self.resumed, self.fair_start, self.arrival_time,
                self.arrival_index)

    def append_output_token_id(self, token_id: int, logprob: float | None = None) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        self._all_token_ids.append(token_id)
        self._extend_block_hashes()

    def _extend_block_hashes(self) -> None:
        # Hash each block once, as soon as it is full; the chain makes each hash cover the prefix.
        size = self.block_size
        while (len(self.block_hashes) + 1) * size <= len(self._all_token_ids):
            start = len(self.block_hashes) * size
            parent = self.block_hashes[-1] if self.block_hashes else root_hash(self.cache_salt)
            self.block_hashes.append(hash_block(parent, self._all_token_ids[start:start + size]))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids})")
