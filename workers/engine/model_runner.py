"""Owns the model and its KV caches: turns a scheduled batch into tensors, runs it, samples."""
from __future__ import annotations

import torch

from workers.engine.config import CacheInfo, EngineConfig
from workers.engine.outputs import ModelRunnerOutput
from workers.engine.request import Request
from workers.engine.sampling import Sampler
from workers.engine.scheduler import SchedulerOutput
from workers.model import AttentionMetadata, allocate_kv_caches, kv_cache_bytes_per_block
from workers.model.llama import LlamaForCausalLM


def _completes(request: Request, num_tokens: int) -> bool:
    """True when this step computes the request's whole sequence, so it samples a token."""
    return request.num_computed_tokens + num_tokens == request.num_tokens


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, config: EngineConfig) -> None:
        self.model = model
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        model_config = model.config
        bytes_per_block = kv_cache_bytes_per_block(model_config, config.block_size,
                                                   config.kv_torch_dtype)
        self.cache_info = CacheInfo.plan(config, bytes_per_block,
                                         model_config.max_position_embeddings)
        self.kv_caches = allocate_kv_caches(model_config, self.cache_info.num_blocks,
                                            config.block_size, self.device, config.kv_torch_dtype)
        self.sampler = Sampler()
        # Seeded requests own a generator for their whole life (preemptions included), so their
        # draws do not depend on who else was in the batch.
        self._generators: dict[str, torch.Generator] = {}

    def prepare_inputs(self, scheduler_output: SchedulerOutput
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten the batch: token ids, positions, attention metadata and the rows to sample."""
        size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc, seq_lens, logits_indices = [0], [], []
        for request, num_tokens in zip(scheduler_output.requests,
                                       scheduler_output.num_scheduled_tokens):
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_tokens
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            table = request.block_ids
            slots.extend(table[pos // size] * size + pos % size for pos in range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            if _completes(request, num_tokens):   # its last row gives the next token's logits
                logits_indices.append(len(input_ids) - 1)
        max_blocks = max(len(r.block_ids) for r in scheduler_output.requests)
        flat_tables: list[int] = []
        for r in scheduler_output.requests:
            flat_tables.extend(r.block_ids)
            flat_tables.extend([0] * (max_blocks - len(r.block_ids)))
        # One host tensor (and one copy to the device) sliced into the seven inputs: right
        # after a forward has streamed the weights through every cache, each torch call costs
        # ~10x its warm time (F.embedding of one row: 46-62 us against 3.5-6, 2-core Zen 3).
        parts = (input_ids, positions, slots, query_start_loc, seq_lens, logits_indices,
                 flat_tables)
        flat: list[int] = []
        for part in parts:
            flat.extend(part)
        ids, pos, slot, qsl, lens, logits, tables = self._tensor(flat).split(
            [len(part) for part in parts])
        metadata = AttentionMetadata(
            slot_mapping=slot, query_start_loc=qsl, seq_lens=lens,
            block_tables=tables.view(len(scheduler_output.requests), max_blocks),
            max_seq_len=max(seq_lens),
            max_query_len=max(scheduler_output.num_scheduled_tokens))
        return ids, pos, metadata, logits

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self._generators.pop(request_id, None)
        input_ids, positions, metadata, logits_indices = self.prepare_inputs(scheduler_output)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        sampled = [r for r, n in zip(scheduler_output.requests,
                                     scheduler_output.num_scheduled_tokens) if _completes(r, n)]
        if not sampled:
            return ModelRunnerOutput()
        # Every row samples (a pure decode step): the indices are 0..T-1, no gather needed.
        rows = hidden if len(sampled) == hidden.shape[0] else hidden[logits_indices]
        logits = self.model.compute_logits(rows)
        params = [r.sampling_params for r in sampled]
        tokens, logprobs = self.sampler(logits, params, [self._generator(r) for r in sampled])
        ids = [r.request_id for r in sampled]
        return ModelRunnerOutput(
            dict(zip(ids, tokens)),
            {rid: lp for rid, lp, p in zip(ids, logprobs, params) if p.logprobs}
            if logprobs is not None else {})

    def _generator(self, request: Request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None or request.sampling_params.greedy:
            return None
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[request.request_id] = generator
        return generator

    def _tensor(self, values: list) -> torch.Tensor:
        # Built on the host and copied once; pinned memory would only matter on CUDA.
        t = torch.tensor(values, dtype=torch.int64)
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)
