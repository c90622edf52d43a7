"""The synchronous engine: one step is schedule -> execute -> update."""
from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch

from llmmesh.errors import InvalidArgument

from workers.engine.config import CacheInfo, EngineConfig
from workers.engine.cpu_priority import StepPriority
from workers.engine.model_runner import ModelRunner
from workers.engine.outputs import EngineLoad, RequestOutput
from workers.engine.request import Priority, Request
from workers.engine.sampling import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.model import load_model
from workers.model.llama import LlamaForCausalLM


class EngineCore:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM | None = None) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if model is None:
            model, _ = load_model(config.gguf_path, device=config.device,
                                  dtype=config.torch_dtype, quantization=config.quantization)
        self.config = config
        # Called from the step thread after each step: (step seconds, tokens, requests).
        self.on_step = None
        self.vocab_size = model.config.vocab_size
        self.runner = ModelRunner(model, config)
        self.cache_info: CacheInfo = self.runner.cache_info
        self.scheduler = Scheduler(config, self.cache_info,
                                   frozenset({model.config.eos_token_id}))
        self.priority = StepPriority(config.batch_nice if torch.device(config.device).type == "cpu"
                                     else None)

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int],
                     sampling: SamplingParams, *, priority: int = Priority.INTERACTIVE,
                     cache_salt: str = "", tenant: str = "", resumed: bool = False) -> Request:
        """A validated request; raises InvalidArgument naming the bad field. Touches no engine
        state, so any thread may call it."""
        if not request_id:
            raise InvalidArgument("request_id", "must not be empty")
        if not prompt_token_ids:
            raise InvalidArgument("prompt_token_ids", "must not be empty")
        max_len = self.cache_info.max_model_len
        if len(prompt_token_ids) >= max_len:
            raise InvalidArgument("prompt_token_ids", f"{len(prompt_token_ids)} tokens leave no "
                                  f"room to generate within the context of {max_len}")
        if not all(0 <= t < self.vocab_size for t in prompt_token_ids):
            raise InvalidArgument("prompt_token_ids", f"ids must be in [0, {self.vocab_size})")
        if priority not in Priority.__members__.values():
            raise InvalidArgument("priority", f"must be one of {[int(p) for p in Priority]}")
        return Request(request_id, prompt_token_ids, sampling, block_size=self.config.block_size,
                       priority=Priority(priority), cache_salt=cache_salt, tenant=tenant,
                       resumed=resumed)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        return self.scheduler.abort(request_id, error)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        self.priority.set_for_step(all(r.priority == Priority.BATCH
                                       for r in scheduler_output.requests))
        runner_output = self.runner.execute(scheduler_output)
        # The wall time of the whole step is billed, so per-request device-seconds add up to the
        # engine's busy time.
        step_s = time.perf_counter() - started
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output, step_s)
        if self.on_step is not None:
            self.on_step(step_s, scheduler_output.total_num_scheduled_tokens,
                         len(scheduler_output.requests))
        return outputs

    def calibrate(self, seed: int = 0) -> None:
        """Warm-up run that also teaches the scheduler's step-time model what a token and a
        key of context cost (workers/engine/step_cost.py): a short prefill and single-sequence
        decodes, eight sequences decoding together, and a long prompt decoded at its full
        context. Seconds on a CPU; leaves no request, no block in use or cached and no
        statistic behind.
        """
        if self.has_work():
            raise RuntimeError("calibrate runs before any request is admitted")
        rng = random.Random(seed)
        capacity = min(self.cache_info.max_model_len, self.cache_info.num_blocks
                       * self.cache_info.block_size // 2)
        plans = [(1, 64, 8), (8, 16, 8), (1, 1024, 8)]
        model = self.scheduler.step_cost
        model.calibrating = True
        try:
            for k, (count, prompt_len, new_tokens) in enumerate(plans):
                prompt_len = min(prompt_len, max(1, capacity // max(count, 1) - new_tokens - 1))
                if prompt_len < 1:
                    continue
                params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
                for i in range(count):
                    ids = [rng.randrange(self.vocab_size) for _ in range(prompt_len)]
                    self.add_request(self.make_request(f"calibrate-{k}-{i}", ids, params,
                                                       cache_salt="calibrate"))
                while self.has_work():
                    self.step()
        finally:
            model.calibrating = False
            self.scheduler.reset_statistics()
            # Its blocks would only show up in the routers' affinity index (published from
            # the newest cached hashes): nobody's prompt can hit the "calibrate" salt.
            self.scheduler.kv.pool.reset_prefix_cache()

    def fail_running(self, error: str) -> list[RequestOutput]:
        """End every running request with an error (after a failed step, their KV is suspect)."""
        running = [r.request_id for r in self.scheduler.running]
        return [self.abort_request(request_id, error) for request_id in running]

    def abort_all(self, error: str) -> list[RequestOutput]:
        return [self.abort_request(request_id, error) for request_id in list(self.scheduler.requests)]

    def load(self) -> EngineLoad:
        return self.scheduler.load()
