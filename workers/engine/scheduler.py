"""Continuous batching: which requests run this step, with how many tokens, and who is preempted."""
from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass

from llmmesh.vocab import FinishReason
from workers.engine.config import CacheInfo, EngineConfig
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.outputs import EngineLoad, ModelRunnerOutput, RequestOutput, RequestUsage
from workers.engine.request import Priority, Request, RequestStatus
from workers.engine.step_cost import StepCostModel, keys_attended

MAX_LOAD_HASHES = 1024   # bounds the cache summary a load report carries to the router
_PROBE_EVERY_STEPS = 16  # with batch in every step, one step in this many runs interactive alone


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    requests: tuple[Request, ...]            # batch order
    num_scheduled_tokens: tuple[int, ...]    # new tokens per request, same order
    finished_request_ids: frozenset[str]     # ended since the last step: runner drops their state
    preempted_request_ids: tuple[str, ...] = ()

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class _StepBatch:
    """The batch being built: token counts per request and what is left of the budgets — the
    step's tokens, batch-class work's own tokens, and (once the step-time model is fitted) the
    seconds batch work may still add to the step.

    With interactive work in the step and a slowdown factor f, batch work may add at most
    (f - 1) × (fixed step cost + the interactive work's predicted cost): the step, and with it
    every interactive token, takes at most f times what the interactive work alone would."""

    def __init__(self, budget: int, batch_budget: int, cost: StepCostModel | None = None,
                 batch_time_s: float | None = None, slowdown: float = 0.0) -> None:
        self.budget = budget
        self.batch_budget = batch_budget
        # Given only with a time budget, which the scheduler sets once the model is fitted.
        self.cost = cost if batch_time_s is not None else None
        self.batch_time_s = batch_time_s or 0.0
        self.slowdown = slowdown if self.cost is not None else 0.0
        # What batch work may still add under the slowdown: (f - 1) × (fixed + interactive
        # work so far) − batch work so far, kept as work is added and discarded.
        self._share_s = (self.slowdown - 1) * self.cost.predict(0, 0) if self.slowdown else 0.0
        self.num_tokens: dict[str, tuple[Request, int]] = {}
        self._cost: dict[str, float] = {}    # predicted seconds of each request's work here
        self._num_batch = 0

    def room(self, request: Request, start: int) -> int:
        """Tokens `request` may add at offset `start` (its computed or cached tokens)."""
        if request.priority != Priority.BATCH:
            return self.budget
        room = min(self.budget, self.batch_budget)
        if self.cost is not None:
            left = min(self.batch_time_s, self._share_s) if self.slowdown else self.batch_time_s
            # Whatever the prediction, the first batch request of a step always advances.
            floor = 0 if self._num_batch else 1
            room = min(room, max(floor, self.cost.tokens_within(start, left)))
        return room

    def _account(self, request: Request, num_tokens: int, cost: float, sign: int) -> None:
        self.budget -= sign * num_tokens
        if request.priority == Priority.BATCH:
            self.batch_budget -= sign * num_tokens
            self.batch_time_s -= sign * cost
            self._share_s -= sign * cost
            self._num_batch += sign
        elif self.slowdown:
            self._share_s += sign * (self.slowdown - 1) * cost

    def add(self, request: Request, num_tokens: int, start: int) -> None:
        self.num_tokens[request.request_id] = (request, num_tokens)
        cost = self.cost.cost(start, num_tokens) if self.cost is not None else 0.0
        self._cost[request.request_id] = cost
        self._account(request, num_tokens, cost, +1)

    def discard(self, request: Request) -> None:
        entry = self.num_tokens.pop(request.request_id, None)
        if entry is not None:
            self._account(request, entry[1], self._cost.pop(request.request_id), -1)


class Scheduler:
    def __init__(self, config: EngineConfig, cache_info: CacheInfo,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.batch_tokens_with_interactive = config.batch_tokens_with_interactive
        self.max_batch_tokens_per_step = config.max_batch_tokens_per_step
        budget_ms = config.batch_step_budget_ms
        self.batch_step_budget_s = None if budget_ms is None else budget_ms / 1e3
        after_ms = config.batch_step_budget_ms_after_interactive
        self.batch_step_budget_after_interactive_s = None if after_ms is None or budget_ms is None \
            else min(after_ms, budget_ms) / 1e3
        self.interactive_recent_s = config.interactive_recent_s
        self._interactive_seen_t = -math.inf   # monotonic time interactive work was last present
        self.batch_s_with_interactive = config.batch_ms_with_interactive / 1e3
        self.interactive_slowdown = config.interactive_slowdown or 0.0
        self.max_batch_skipped_steps = config.max_batch_skipped_steps
        self._batch_skipped = 0   # steps in a row with interactive work where batch did not run
        # Measured step seconds (EMA) of steps with interactive work, without and with batch
        # work in them; and what the step being run is ("alone", "mixed" or None).
        self._interactive_step_s: dict[str, float] = {}
        self._step_kind: str | None = None
        self._mixed_streak = 0    # steps in a row with interactive and batch work
        self.step_cost = StepCostModel()
        self.max_model_len = cache_info.max_model_len
        self.eos_token_ids = eos_token_ids
        self.kv = KVCacheManager(cache_info.num_blocks, cache_info.block_size,
                                 config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []      # kept sorted by Request.sort_key
        self._virtual_time: dict[int, float] = {}            # per class: last admitted start tag
        self._tenant_finish: dict[tuple[int, str], float] = {}   # per (class, tenant)
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        if request.tenant:
            # Start-time fair queueing per class: a request starts at the later of the class's
            # virtual time (the start tag last admitted) and its tenant's last finish tag, and
            # finishes its work (prompt + max tokens) later. A tenant that sends many at once
            # is interleaved with others instead of ahead of them; an idle one gets no credit.
            key = (request.priority, request.tenant)
            start = max(self._virtual_time.get(request.priority, 0.0),
                        self._tenant_finish.get(key, 0.0))
            request.fair_start = start
            self._tenant_finish[key] = start + request.num_prompt_tokens + \
                request.sampling_params.max_tokens
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def has_interactive(self) -> bool:
        return any(r.priority == Priority.INTERACTIVE for r in self.running) or any(
            r.priority == Priority.INTERACTIVE for r in self.waiting)

    def _new_batch(self, interactive: bool) -> _StepBatch:
        guard = self.batch_tokens_with_interactive
        tokens = guard if guard and interactive else self.max_batch_tokens_per_step
        seconds, slowdown = None, 0.0
        if self.batch_step_budget_s is not None and self.step_cost.ready:
            if interactive:
                seconds, slowdown = self.batch_s_with_interactive, self.interactive_slowdown
            else:
                # At least the step's fixed cost again: where the fixed cost (the weights'
                # stream) alone exceeds the budget, a batch-only step would otherwise carry one
                # token of one request; a chat then waits at most about one more of its steps.
                fixed = self.step_cost.predict(0, 0)
                seconds = max(self._batch_only_budget_s() - fixed, fixed)
        probe = self._mixed_streak >= _PROBE_EVERY_STEPS and self.batch_every_steps_on()
        if interactive and (self._batch_skipped + 1 < self.batch_every_steps() or probe):
            # Not this step's turn, or a probe: the interactive work runs alone (and its time
            # alone stays measured while batch rides along every step).
            tokens = 0
        return _StepBatch(self.max_num_batched_tokens, tokens, self.step_cost, seconds, slowdown)

    def _batch_only_budget_s(self) -> float:
        """What a step holding only batch work is planned to take: shorter while chat traffic
        is recent (a chat arriving mid-step waits for the rest of it)."""
        short = self.batch_step_budget_after_interactive_s
        if short is not None and \
                time.monotonic() - self._interactive_seen_t < self.interactive_recent_s:
            return short
        return self.batch_step_budget_s

    def batch_every_steps_on(self) -> bool:
        return self.interactive_slowdown > 1 and self.max_batch_skipped_steps > 0

    def batch_every_steps(self) -> int:
        """k: steps holding interactive work take batch work along once every k steps."""
        f = self.interactive_slowdown
        if not self.batch_every_steps_on():
            return 1
        alone, mixed = (self._interactive_step_s.get(k) for k in ("alone", "mixed"))
        if alone is None or mixed is None:
            return 1   # until both are measured (probes measure the time alone)
        k = math.ceil(max(0.0, mixed / alone - 1) / (f - 1) - 1e-9)
        return max(1, min(k, self.max_batch_skipped_steps + 1))

    def _count_batch_skips(self, batch: _StepBatch, interactive: bool) -> None:
        with_batch = any(r.priority == Priority.BATCH for r, _ in batch.num_tokens.values())
        # Measured like for like: steps whose interactive work is decodes only (what TPOT is).
        decodes = [n for r, n in batch.num_tokens.values() if r.priority != Priority.BATCH]
        self._step_kind = None if not decodes or any(n != 1 for n in decodes) else (
            "mixed" if with_batch else "alone")
        self._mixed_streak = self._mixed_streak + 1 if interactive and with_batch else 0
        if not interactive or with_batch:
            self._batch_skipped = 0
        elif any(r.priority == Priority.BATCH for r in self.running) or any(
                r.priority == Priority.BATCH for r in self.waiting):
            self._batch_skipped += 1

    def _observe_kind(self, step_s: float) -> None:
        kind, self._step_kind = self._step_kind, None
        if kind is None or step_s <= 0:
            return
        last = self._interactive_step_s.get(kind)
        self._interactive_step_s[kind] = step_s if last is None else 0.9 * last + 0.1 * step_s

    def schedule(self) -> SchedulerOutput:
        interactive = self.has_interactive()
        if interactive:
            self._interactive_seen_t = time.monotonic()
        batch = self._new_batch(interactive)
        preempted: list[Request] = []
        self._schedule_running(batch, preempted)
        # A step that had to preempt is short of blocks: admitting now would only thrash.
        if not preempted:
            self._schedule_waiting(batch, preempted)
        self._count_batch_skips(batch, interactive)
        finished, self._finished_ids = frozenset(self._finished_ids), set()
        entries = list(batch.num_tokens.values())
        return SchedulerOutput(tuple(r for r, _ in entries), tuple(n for _, n in entries),
                               finished, tuple(r.request_id for r in preempted))

    def _schedule_running(self, batch: _StepBatch, preempted: list[Request]) -> None:
        # Best first, so under block pressure the victims (taken from the tail) are never
        # requests already placed in this step's batch.
        self.running.sort(key=lambda r: r.sort_key)
        i = 0
        while i < len(self.running) and batch.budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            num_new = min(request.num_tokens - start, batch.room(request, start))
            if num_new <= 0:  # batch work past its share of this step: it waits one step
                i += 1
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                batch.add(request, num_new, start)
                i += 1

    def _schedule_waiting(self, batch: _StepBatch, preempted: list[Request]) -> None:
        while self.waiting and batch.budget > 0:
            request = self.waiting[0]
            # A resumed completion may take up to max_num_seqs seats past the cap: its client
            # waits mid-stream for a seat to free, while a decode step grows far less than that
            # wait with a few more sequences (it streams the weights once for all of them).
            seats = self.max_num_seqs * (2 if request.resumed else 1)
            if (len(self.running) >= seats
                    and not self._preempt_lower_priority(request, batch, preempted)):
                return
            hits, num_cached = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_cached, batch.room(request, num_cached))
            if num_new <= 0:
                return
            while self.kv.allocate_slots(request, num_new, hits) is None:
                if not self._preempt_lower_priority(request, batch, preempted):
                    return   # strict order: nobody overtakes the head of the queue
            self.waiting.pop(0)
            if request.tenant and not request.resumed:   # it went ahead of its turn
                self._virtual_time[request.priority] = max(
                    self._virtual_time.get(request.priority, 0.0), request.fair_start)
            self._admit(request, num_cached)
            batch.add(request, num_new, num_cached)

    def _preempt_lower_priority(self, request: Request, batch: _StepBatch,
                                preempted: list[Request]) -> bool:
        """Make room for `request` by preempting the worst running request of a strictly lower
        class (interactive evicts batch, never the reverse, never its own class)."""
        candidates = [r for r in self.running if r.priority > request.priority]
        if not candidates:
            return False
        victim = max(candidates, key=lambda r: r.sort_key)
        batch.discard(victim)
        self._preempt(victim)
        preempted.append(victim)
        return True

    def _preempt(self, request: Request) -> None:
        # Preemption by recompute: drop the KV (its full blocks stay cached, so the recompute
        # is mostly prefix hits) and requeue at the original arrival position.
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def _admit(self, request: Request, num_cached: int) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = num_cached
            self.num_prefix_query_tokens += request.num_tokens
            self.num_prefix_hit_tokens += num_cached
        self.running.append(request)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput, step_s: float) -> list[RequestOutput]:
        """Advance each scheduled request by the step's result; return what to stream."""
        outputs = []
        total = scheduler_output.total_num_scheduled_tokens
        self._observe_kind(step_s)
        self.step_cost.observe(total, sum(
            keys_attended(r.num_computed_tokens, n) for r, n in zip(
                scheduler_output.requests, scheduler_output.num_scheduled_tokens)), step_s)
        for request, num_tokens in zip(scheduler_output.requests,
                                       scheduler_output.num_scheduled_tokens):
            if request.status != RequestStatus.RUNNING:
                continue
            self._charge(request, num_tokens, step_s * num_tokens / total)
            request.num_computed_tokens += num_tokens
            self.kv.cache_blocks(request)
            token = runner_output.sampled_token_ids.get(request.request_id)
            if token is None:
                continue   # a prefill chunk: nothing to stream yet
            logprob = runner_output.logprobs.get(request.request_id)
            request.append_output_token_id(token, logprob)
            status = self._stop_status(request, token)
            if status is not None:
                self._finish(request, status)
            outputs.append(self._output(request, [token], None if logprob is None else [logprob]))
        return outputs

    @staticmethod
    def _charge(request: Request, num_tokens: int, device_s: float) -> None:
        # Tokens below the prompt length are prefill; the rest (decodes, and the recompute of
        # generated tokens after a preemption) are decode work.
        start = request.num_computed_tokens
        num_prefill = max(0, min(start + num_tokens, request.num_prompt_tokens) - start)
        request.prefill_device_s += device_s * num_prefill / num_tokens
        request.decode_device_s += device_s * (num_tokens - num_prefill) / num_tokens

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def abort(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """End a waiting or running request now, freeing its blocks; None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return self._output(request, [], None, error)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = status
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)

    def _output(self, request: Request, token_ids: list[int], logprobs: list[float] | None,
                error: str | None = None) -> RequestOutput:
        if not request.status.finished:
            return RequestOutput(request.request_id, token_ids, logprobs, False)
        reason = FinishReason.ERROR if error is not None else request.status.finish_reason
        return RequestOutput(request.request_id, token_ids, logprobs, True, reason,
                             self._usage(request), error)

    @staticmethod
    def _usage(request: Request) -> RequestUsage:
        admitted = request.first_scheduled_time or time.monotonic()
        first_token = request.first_token_time
        return RequestUsage(request.num_prompt_tokens, request.num_cached_tokens,
                            request.num_output_tokens, request.prefill_device_s,
                            request.decode_device_s, admitted - request.arrival_time,
                            request.num_preemptions,
                            first_token - admitted if first_token is not None else 0.0)

    def reset_statistics(self) -> None:
        """Forget the prefix-cache hit counters (after a warm-up run)."""
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    def load(self) -> EngineLoad:
        pool = self.kv.pool
        queried = self.num_prefix_query_tokens
        return EngineLoad(len(self.running), len(self.waiting), pool.num_free_blocks,
                          pool.num_blocks, self.kv.block_size,
                          tuple(pool.recent_hashes(MAX_LOAD_HASHES)),
                          self.num_prefix_hit_tokens / queried if queried else 0.0)
