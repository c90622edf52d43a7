"""Scheduler without a model: token budgets, chunked prefill, priorities, preemption, stops, billing."""
from __future__ import annotations

import pytest

from workers.engine.config import CacheInfo, EngineConfig
from workers.engine.outputs import ModelRunnerOutput
from workers.engine.request import Priority, Request, RequestStatus
from workers.engine.sampling import SamplingParams
from workers.engine.scheduler import Scheduler

BLOCK, EOS, TOKEN = 4, 2, 7
I, B = Priority.INTERACTIVE, Priority.BATCH


def make_scheduler(num_blocks=32, budget=64, max_seqs=8, max_model_len=128,
                   caching=True) -> Scheduler:
    config = EngineConfig(block_size=BLOCK, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                          enable_prefix_caching=caching)
    return Scheduler(config, CacheInfo(num_blocks, BLOCK, 1, max_model_len), frozenset({EOS}))


def add(scheduler: Scheduler, request_id: str, num_prompt: int, *, priority=I, arrival=0.0,
        first_token=10, **sampling) -> Request:
    params = SamplingParams(**{"max_tokens": 8, "temperature": 0, **sampling})
    request = Request(request_id, list(range(first_token, first_token + num_prompt)), params,
                      block_size=BLOCK, priority=priority, arrival_time=arrival)
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler, token=TOKEN, step_s=1.0):
    out = scheduler.schedule()
    sampled = {r.request_id: token for r, n in zip(out.requests, out.num_scheduled_tokens)
               if r.num_computed_tokens + n == r.num_tokens}
    return out, scheduler.update_from_output(out, ModelRunnerOutput(sampled), step_s)


def plan(out) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in zip(out.requests, out.num_scheduled_tokens)]


def test_chunked_prefill_shares_the_budget_with_decodes():
    scheduler = make_scheduler(budget=8)
    add(scheduler, "a", 3, arrival=0)
    add(scheduler, "b", 10, arrival=1)
    out, outputs = step(scheduler)
    assert plan(out) == [("a", 3), ("b", 5)]
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", [TOKEN])]
    out, outputs = step(scheduler)
    assert plan(out) == [("a", 1), ("b", 5)]
    assert [o.request_id for o in outputs] == ["a", "b"]
    out, _ = step(scheduler)
    assert plan(out) == [("a", 1), ("b", 1)]


def test_interactive_is_admitted_before_an_earlier_batch_request():
    scheduler = make_scheduler(max_seqs=1)
    add(scheduler, "batch", 4, priority=B, arrival=0)
    add(scheduler, "chat", 4, priority=I, arrival=1)
    out, _ = step(scheduler)
    assert plan(out) == [("chat", 4)]


def test_within_a_class_first_come_first_served():
    scheduler = make_scheduler(max_seqs=1)
    add(scheduler, "late", 4, priority=B, arrival=1)
    add(scheduler, "early", 4, priority=B, arrival=0)
    out, _ = step(scheduler)
    assert plan(out) == [("early", 4)]


def test_out_of_blocks_preempts_batch_before_an_older_interactive():
    scheduler = make_scheduler(num_blocks=6)
    batch = add(scheduler, "batch", 8, priority=B, arrival=0)
    add(scheduler, "i1", 8, arrival=1)
    add(scheduler, "i2", 8, arrival=2)
    step(scheduler)                                   # 3 x 2 blocks: the pool is full
    out, _ = step(scheduler)                          # each decode needs a third block
    assert plan(out) == [("i1", 1), ("i2", 1)]
    assert out.preempted_request_ids == ("batch",)
    assert batch.status == RequestStatus.PREEMPTED and batch.num_preemptions == 1
    assert batch.num_computed_tokens == 0 and batch.block_ids == []
    assert scheduler.waiting == [batch]


def test_out_of_blocks_in_one_class_preempts_the_latest_arrival():
    scheduler = make_scheduler(num_blocks=6)
    for i in range(3):
        add(scheduler, f"r{i}", 8, arrival=i)
    step(scheduler)
    out, _ = step(scheduler)
    assert plan(out) == [("r0", 1), ("r1", 1)] and out.preempted_request_ids == ("r2",)


def test_preempted_request_resumes_and_recomputes_its_generated_tokens():
    scheduler = make_scheduler(num_blocks=6)
    batch = add(scheduler, "batch", 8, priority=B, arrival=0)
    add(scheduler, "i1", 8, arrival=1, max_tokens=2)
    add(scheduler, "i2", 8, arrival=2, max_tokens=2)
    step(scheduler)
    step(scheduler)                                   # batch preempted; i1, i2 finish
    out, outputs = step(scheduler)
    assert plan(out) == [("batch", 1)]                # its 2 full blocks survived as cache hits
    assert batch.output_token_ids == [TOKEN, TOKEN] and outputs[0].new_token_ids == [TOKEN]
    assert batch.num_cached_tokens == 0               # usage reports the first admission


def test_full_batch_seats_interactive_by_preempting_batch():
    scheduler = make_scheduler(max_seqs=2)
    add(scheduler, "b1", 4, priority=B, arrival=0)
    b2 = add(scheduler, "b2", 4, priority=B, arrival=1)
    step(scheduler)
    add(scheduler, "chat", 4, priority=I, arrival=2)
    out, _ = step(scheduler)
    assert plan(out) == [("b1", 1), ("chat", 4)]
    assert out.preempted_request_ids == ("b2",) and b2.status == RequestStatus.PREEMPTED


def test_full_batch_never_preempts_the_same_or_a_higher_class():
    scheduler = make_scheduler(max_seqs=2)
    add(scheduler, "i1", 4, arrival=0)
    add(scheduler, "i2", 4, arrival=1)
    add(scheduler, "b1", 4, priority=B, arrival=2)
    step(scheduler)
    add(scheduler, "i3", 4, arrival=3)
    out, _ = step(scheduler)
    assert plan(out) == [("i1", 1), ("i2", 1)] and out.preempted_request_ids == ()
    assert [r.request_id for r in scheduler.waiting] == ["i3", "b1"]


def test_abort_frees_blocks_at_once_and_is_reported_to_the_runner():
    scheduler = make_scheduler(num_blocks=8)
    add(scheduler, "a", 9, arrival=0)
    add(scheduler, "w", 4, arrival=1, max_tokens=1)
    scheduler.schedule()
    assert scheduler.kv.num_free_blocks == 4
    final = scheduler.abort("a")
    assert final.finished and final.finish_reason == "cancelled" and final.new_token_ids == []
    assert final.usage.prompt_tokens == 9 and final.usage.completion_tokens == 0
    assert scheduler.kv.num_free_blocks == 7               # w still holds one
    assert scheduler.abort("a") is None and scheduler.abort("nope") is None
    assert scheduler.schedule().finished_request_ids == {"a"}


def test_abort_of_a_waiting_request():
    scheduler = make_scheduler(max_seqs=1)
    add(scheduler, "a", 4, arrival=0)
    add(scheduler, "b", 4, arrival=1)
    assert scheduler.abort("b").finish_reason == "cancelled"
    assert scheduler.waiting[0].request_id == "a" and len(scheduler.waiting) == 1


@pytest.mark.parametrize("token, sampling, reason, num_outputs", [
    (EOS, {}, "stop", 1),
    (5, {"stop_token_ids": [5]}, "stop", 1),
    (EOS, {"ignore_eos": True, "max_tokens": 3}, "length", 3),
    (TOKEN, {"max_tokens": 2}, "length", 2),
])
def test_stop_conditions(token, sampling, reason, num_outputs):
    scheduler = make_scheduler()
    request = add(scheduler, "a", 4, **sampling)
    outputs = []
    while scheduler.has_work():
        outputs += step(scheduler, token=token)[1]
    assert [o.finished for o in outputs] == [False] * (num_outputs - 1) + [True]
    assert outputs[-1].finish_reason == reason and request.num_output_tokens == num_outputs
    assert scheduler.kv.num_free_blocks == 32 and scheduler.requests == {}


def test_context_limit_stops_with_length():
    scheduler = make_scheduler(max_model_len=6)
    add(scheduler, "a", 4, max_tokens=100)
    outputs = []
    while scheduler.has_work():
        outputs += step(scheduler)[1]
    assert len(outputs) == 2 and outputs[-1].finish_reason == "length"


def test_step_time_is_split_by_tokens_and_by_kind():
    scheduler = make_scheduler(budget=8)
    a = add(scheduler, "a", 3, arrival=0)
    b = add(scheduler, "b", 10, arrival=1)
    step(scheduler, step_s=8.0)                       # a: 3 prefill, b: 5 prefill
    assert (a.prefill_device_s, b.prefill_device_s) == (3.0, 5.0)
    step(scheduler, step_s=6.0)                       # a: 1 decode, b: 5 prefill
    assert (a.prefill_device_s, a.decode_device_s) == (3.0, 1.0)
    assert (b.prefill_device_s, b.decode_device_s) == (10.0, 0.0)


def test_recompute_of_generated_tokens_is_billed_as_decode():
    scheduler = make_scheduler(caching=False)
    request = add(scheduler, "a", 3)
    step(scheduler)
    step(scheduler)                                   # 3 prompt + 2 generated tokens
    scheduler._preempt(request)
    request.prefill_device_s = request.decode_device_s = 0.0
    out, _ = step(scheduler, step_s=5.0)
    assert plan(out) == [("a", 5)]
    assert (request.prefill_device_s, request.decode_device_s) == (3.0, 2.0)


def test_prefix_hit_is_reported_in_usage_and_skips_computed_tokens():
    scheduler = make_scheduler()
    add(scheduler, "a", 10, max_tokens=1)
    step(scheduler)
    add(scheduler, "b", 10, max_tokens=1)
    out, outputs = step(scheduler)
    assert plan(out) == [("b", 2)]
    assert outputs[0].usage.cached_prompt_tokens == 8 and outputs[0].usage.prompt_tokens == 10
    assert scheduler.load().prefix_cache_hit_rate == 8 / 20


def test_batch_work_shrinks_to_its_share_while_interactive_is_present():
    config = EngineConfig(block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=64,
                          batch_tokens_with_interactive=2)
    scheduler = Scheduler(config, CacheInfo(64, BLOCK, 1, 128), frozenset({EOS}))
    for i in range(4):
        add(scheduler, f"b{i}", 3, priority=B, arrival=i, max_tokens=20)
    step(scheduler)  # all four batch prompts prefill together: nobody interactive yet
    out, _ = step(scheduler)
    assert plan(out) == [("b0", 1), ("b1", 1), ("b2", 1), ("b3", 1)]
    add(scheduler, "chat", 5, priority=I, arrival=10)
    out, _ = step(scheduler)
    # The user's prefill runs with at most 2 batch tokens beside it; b2, b3 wait one step.
    assert plan(out) == [("b0", 1), ("b1", 1), ("chat", 5)]
    out, _ = step(scheduler)
    assert plan(out) == [("chat", 1), ("b0", 1), ("b1", 1)]
    assert all(r.status == RequestStatus.RUNNING for r in scheduler.running)  # none preempted


def test_batch_share_guard_off_runs_everything():
    config = EngineConfig(block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=64,
                          batch_tokens_with_interactive=0)
    scheduler = Scheduler(config, CacheInfo(64, BLOCK, 1, 128), frozenset({EOS}))
    for i in range(4):
        add(scheduler, f"b{i}", 3, priority=B, arrival=i, max_tokens=20)
    step(scheduler)
    add(scheduler, "chat", 5, priority=I, arrival=10)
    out, _ = step(scheduler)
    assert sorted(plan(out)) == [("b0", 1), ("b1", 1), ("b2", 1), ("b3", 1), ("chat", 5)]


def _teach(scheduler: Scheduler, fixed: float, per_token: float, per_kkey: float) -> None:
    """Give the step-time model exact costs (as if it had timed these steps)."""
    for tokens, keys in [(1, 50), (8, 9000), (16, 2000), (32, 600), (64, 40000), (4, 30000)] * 3:
        scheduler.step_cost.observe(tokens, keys, fixed + per_token * tokens + per_kkey * keys / 1e3)


def _time_capped(budget_ms=50.0, with_interactive_ms=10.0, blocks=1024, slowdown=0.0):
    config = EngineConfig(block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=256,
                          max_batch_tokens_per_step=64, batch_step_budget_ms=budget_ms,
                          batch_ms_with_interactive=with_interactive_ms,
                          interactive_slowdown=slowdown)
    return Scheduler(config, CacheInfo(blocks, BLOCK, 1, 4096), frozenset({EOS}))


def test_batch_prefill_chunk_shrinks_to_the_time_budget():
    scheduler = _time_capped()
    add(scheduler, "b0", 900, priority=B, max_tokens=20)
    out = scheduler.schedule()
    assert plan(out) == [("b0", 64)]              # the model knows nothing yet: token cap
    scheduler = _time_capped()
    add(scheduler, "b0", 900, priority=B, max_tokens=20)
    _teach(scheduler, fixed=0.010, per_token=0.002, per_kkey=0.0)
    # (50 - 10) ms at 2 ms per token: 20 tokens.
    assert plan(scheduler.schedule()) == [("b0", 20)]


def test_cheap_steps_keep_the_token_cap_and_no_budget_means_no_time_cap():
    for budget_ms, per_token in ((50.0, 0.0001), (None, 0.010)):
        scheduler = _time_capped(budget_ms)
        add(scheduler, "b0", 900, priority=B, max_tokens=20)
        _teach(scheduler, fixed=0.001, per_token=per_token, per_kkey=0.0)
        assert plan(scheduler.schedule()) == [("b0", 64)]


def _long_context_decoders(scheduler: Scheduler, count: int, context: int) -> None:
    for i in range(count):
        add(scheduler, f"b{i}", context, priority=B, arrival=i, max_tokens=50)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running) \
            or scheduler.waiting:
        step(scheduler, step_s=0.0)   # prefill with the model off (0 s steps are not observed)


def test_long_context_batch_decodes_ride_along_with_a_chat_only_within_its_time_share():
    scheduler = _time_capped(with_interactive_ms=12.0, blocks=4096)
    _long_context_decoders(scheduler, 3, 2000)
    # Each decode at a 2,000-token context: 1 ms + 4 ms of attention.
    _teach(scheduler, fixed=0.004, per_token=0.001, per_kkey=0.002)
    out = scheduler.schedule()                   # no user waiting: all three fit in 50 ms
    assert plan(out) == [("b0", 1), ("b1", 1), ("b2", 1)]
    scheduler.update_from_output(out, ModelRunnerOutput({f"b{i}": TOKEN for i in range(3)}), 0.0)
    add(scheduler, "chat", 5, priority=I, arrival=10, first_token=30000)
    out = scheduler.schedule()
    # 12 ms for batch beside the user's prefill: two long decodes (2 x 5 ms), not three.
    assert plan(out) == [("b0", 1), ("b1", 1), ("chat", 5)]
    assert all(r.status == RequestStatus.RUNNING for r in scheduler.running)


@pytest.mark.parametrize("slowdown, batch_decodes", [(0.0, 2), (1.5, 1), (2.0, 1), (3.0, 2),
                                                     (5.0, 2)])
def test_batch_beside_a_running_chat_keeps_its_step_within_the_slowdown(slowdown, batch_decodes):
    scheduler = _time_capped(with_interactive_ms=12.0, blocks=4096, slowdown=slowdown)
    _long_context_decoders(scheduler, 3, 2000)
    add(scheduler, "chat", 5, priority=I, arrival=10, first_token=30000)
    step(scheduler, step_s=0.0)                  # the chat's prefill: it now decodes
    # fixed 4 ms; a decode 1 ms + 2 ms per 1,000 keys: the chat's (~5 keys) ~1 ms, a batch
    # decode at 2,000 keys 5 ms. The chat alone: a 5 ms step. Slowdown f lets batch add
    # (f - 1) x 5 ms: 2.5 ms (f 1.5, only the first batch request, which always advances),
    # 5 ms (f 2: one), 10 ms (f 3: two); never more than the 12 ms cap (f 5: two, not four).
    _teach(scheduler, fixed=0.004, per_token=0.001, per_kkey=0.002)
    out = scheduler.schedule()
    assert ("chat", 1) in plan(out)
    assert sum(1 for rid, _ in plan(out) if rid.startswith("b")) == batch_decodes


def test_without_a_user_waiting_the_slowdown_does_not_apply():
    scheduler = _time_capped(with_interactive_ms=12.0, blocks=4096, slowdown=1.5)
    _long_context_decoders(scheduler, 3, 2000)
    _teach(scheduler, fixed=0.004, per_token=0.001, per_kkey=0.002)
    assert plan(scheduler.schedule()) == [("b0", 1), ("b1", 1), ("b2", 1)]   # 50 ms budget


def test_a_batch_only_step_may_take_its_fixed_cost_again_when_that_is_over_the_budget():
    # A slow model: the weights' stream alone (40 ms) is over the 30 ms budget. Batch-only steps
    # still decode every batch request (40 ms more), not one token of one request per step.
    scheduler = _time_capped(budget_ms=30.0, blocks=4096)
    _long_context_decoders(scheduler, 3, 100)
    _teach(scheduler, fixed=0.040, per_token=0.001, per_kkey=0.0)
    assert plan(scheduler.schedule()) == [("b0", 1), ("b1", 1), ("b2", 1)]
    scheduler = _time_capped(budget_ms=30.0, blocks=4096)   # ...but no more than that
    add(scheduler, "b0", 900, priority=B, max_tokens=20)
    _teach(scheduler, fixed=0.040, per_token=0.002, per_kkey=0.0)
    (request_id, tokens), = plan(scheduler.schedule())
    assert request_id == "b0" and 19 <= tokens <= 20      # 40 ms at 2 ms a token (as fitted)


def test_the_first_batch_request_always_advances_even_over_budget():
    scheduler = _time_capped(with_interactive_ms=0.0, blocks=4096)
    _long_context_decoders(scheduler, 2, 2000)
    _teach(scheduler, fixed=0.004, per_token=0.001, per_kkey=0.002)
    add(scheduler, "chat", 5, priority=I, arrival=10, first_token=30000)
    assert plan(scheduler.schedule()) == [("b0", 1), ("chat", 5)]


def test_batch_only_steps_are_shorter_while_chat_traffic_is_recent(monkeypatch):
    import time as time_module
    clock = [100.0]
    monkeypatch.setattr(time_module, "monotonic", lambda: clock[0])
    config = EngineConfig(block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=256,
                          max_batch_tokens_per_step=64, batch_step_budget_ms=50.0,
                          batch_step_budget_ms_after_interactive=20.0, interactive_recent_s=10.0,
                          interactive_slowdown=0.0)
    scheduler = Scheduler(config, CacheInfo(1024, BLOCK, 1, 4096), frozenset({EOS}))
    _teach(scheduler, fixed=0.010, per_token=0.002, per_kkey=0.0)
    add(scheduler, "b0", 900, priority=B, max_tokens=20)
    out, _ = step(scheduler, step_s=0.0)
    assert plan(out) == [("b0", 20)]             # no chat seen yet: (50 - 10) ms at 2 ms a token
    add(scheduler, "chat", 3, priority=I, arrival=1, first_token=30000, max_tokens=1)
    out, _ = step(scheduler, step_s=0.0)         # the chat runs and finishes in this step
    assert ("chat", 3) in plan(out) and not scheduler.has_interactive()
    clock[0] += 9.0                              # 9 s later: (20 - 10) ms, 5 tokens
    assert plan(step(scheduler, step_s=0.0)[0]) == [("b0", 5)]
    clock[0] += 1.5                              # 10.5 s after the chat: the whole step again
    assert plan(step(scheduler, step_s=0.0)[0]) == [("b0", 20)]


def test_usage_reports_the_prefill_s_wall_time_beside_its_device_time(monkeypatch):
    import time as time_module
    clock = [100.0]
    monkeypatch.setattr(time_module, "monotonic", lambda: clock[0])
    scheduler = make_scheduler(budget=8)
    add(scheduler, "short", 3, arrival=99.0, max_tokens=1)   # prefilled in one step
    add(scheduler, "long", 12, arrival=99.0, max_tokens=1)   # two prefill chunks
    _, first = step(scheduler, step_s=0.5)                    # both admitted at 100
    clock[0] = 105.0                                          # other work took the device
    _, outputs = step(scheduler, step_s=0.5)
    (final,) = [o for o in outputs if o.request_id == "long"]
    # Its share of device time is what it used; the client waited the wall time.
    assert (final.usage.queue_s, final.usage.prefill_s) == (1.0, 5.0)
    assert 0 < final.usage.prefill_device_s < final.usage.prefill_s
    (short,) = [o for o in first if o.request_id == "short"]
    assert short.finished and short.usage.prefill_s == 0.0   # first token in its first step


def test_a_tenant_that_floods_the_queue_is_interleaved_with_another_not_ahead_of_it():
    scheduler = make_scheduler(max_seqs=1)
    for i in range(6):   # acme sends six at once, then globex one
        scheduler.add_request(Request(f"acme{i}", [10, 11, 12], SamplingParams(max_tokens=1,
                                      temperature=0), block_size=BLOCK, tenant="acme",
                                      arrival_time=float(i)))
    scheduler.add_request(Request("globex0", [20, 21, 22], SamplingParams(max_tokens=1,
                                  temperature=0), block_size=BLOCK, tenant="globex",
                                  arrival_time=6.0))
    order = []
    while scheduler.has_work():
        out, _ = step(scheduler)
        order += [r.request_id for r in out.requests if r.request_id not in order]
    # Start tags: acme 0, 4, 8, …; globex starts at the class's virtual time (0): second, not
    # seventh. Requests without a tenant keep arrival order (the other tests).
    assert order[:2] == ["acme0", "globex0"] and order[2:] == [f"acme{i}" for i in range(1, 6)]


def test_an_idle_tenant_gets_no_credit_for_its_idle_time():
    scheduler = make_scheduler(max_seqs=1)
    def req(rid, tenant, t):
        return Request(rid, [10, 11, 12], SamplingParams(max_tokens=1, temperature=0),
                       block_size=BLOCK, tenant=tenant, arrival_time=t)
    for i in range(3):
        scheduler.add_request(req(f"acme{i}", "acme", float(i)))
    while scheduler.has_work():
        step(scheduler)
    # acme's work so far moved the class's clock; globex, idle until now, starts there, and
    # acme's next request after it: one each, not globex's backlog of credit first.
    for i in range(3):
        scheduler.add_request(req(f"globex{i}", "globex", 10.0 + i))
    scheduler.add_request(req("acme3", "acme", 13.0))
    order = []
    while scheduler.has_work():
        out, _ = step(scheduler)
        order += [r.request_id for r in out.requests if r.request_id not in order]
    assert order.index("acme3") <= 2


def test_a_resumed_completion_goes_ahead_of_its_class_but_not_of_a_higher_one():
    """A request that another worker broke off mid-stream (its client waits between two tokens)
    is admitted before this worker's own waiting requests of its class, whatever their tenant
    tags; interactive still goes before a resumed batch request. The waiting it jumped keeps
    its tenant-fair order."""
    scheduler = make_scheduler(max_seqs=1)
    def req(rid, tenant, t, priority=I, resumed=False):
        return Request(rid, [10, 11, 12], SamplingParams(max_tokens=1, temperature=0),
                       block_size=BLOCK, tenant=tenant, arrival_time=t, priority=priority,
                       resumed=resumed)
    for i in range(3):
        scheduler.add_request(req(f"acme{i}", "acme", float(i)))
    scheduler.add_request(req("globex0", "globex", 3.0))
    scheduler.add_request(req("batch-resumed", "acme", 4.0, priority=B, resumed=True))
    scheduler.add_request(req("acme-resumed", "acme", 5.0, resumed=True))
    order = []
    while scheduler.has_work():
        out, _ = step(scheduler)
        order += [r.request_id for r in out.requests if r.request_id not in order]
    assert order == ["acme-resumed", "acme0", "globex0", "acme1", "acme2", "batch-resumed"]


def test_a_resumed_completion_takes_a_seat_past_the_cap_and_new_work_does_not():
    scheduler = make_scheduler(max_seqs=2)
    for rid in ("a", "b"):
        add(scheduler, rid, 4, max_tokens=50)
    step(scheduler)
    params = SamplingParams(max_tokens=5, temperature=0)
    scheduler.add_request(Request("new", [30, 31, 32], params, block_size=BLOCK))
    for i in range(3):   # a worker died with three completions in flight: two seats past 2
        scheduler.add_request(Request(f"resumed{i}", [40 + i, 41, 42], params, block_size=BLOCK,
                                      resumed=True))
    out, _ = step(scheduler)
    assert {r.request_id for r in out.requests} == {"a", "b", "resumed0", "resumed1"}
    assert [r.request_id for r in scheduler.waiting] == ["resumed2", "new"]


def _duty_cycle(slowdown: float, mixed_s: float, alone_s: float = 0.005, steps: int = 120,
                max_skipped: int = 16) -> list[bool]:
    """Steps with a chat decoding beside a long batch prompt, timed as given: which took the
    batch work along (the last 40)."""
    config = EngineConfig(block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=64,
                          interactive_slowdown=slowdown, max_batch_skipped_steps=max_skipped)
    scheduler = Scheduler(config, CacheInfo(4096, BLOCK, 1, 8192), frozenset({EOS}))
    add(scheduler, "chat", 4, priority=I, max_tokens=steps + 10)
    add(scheduler, "b0", 6000, priority=B, max_tokens=8)
    step(scheduler)                                          # both admitted; chat decodes next
    took = []
    for _ in range(steps):
        out = scheduler.schedule()
        with_batch = any(r.request_id == "b0" for r in out.requests)
        sampled = {r.request_id: TOKEN for r, n in zip(out.requests, out.num_scheduled_tokens)
                   if r.num_computed_tokens + n == r.num_tokens}
        scheduler.update_from_output(out, ModelRunnerOutput(sampled),
                                     mixed_s if with_batch else alone_s)
        took.append(with_batch)
    return took[-40:]


@pytest.mark.parametrize("slowdown, mixed_s, every", [
    (1.5, 0.010, 2),     # batch doubles the step: it rides along every other step
    (1.5, 0.0125, 3),    # 2.5x: every third step (mean 1.5x)
    (3.0, 0.010, 1),     # within the factor: every step, but one in 17 probes the time alone
    (1.5, 0.500, 17),    # 100x: every 17th step (16 skipped at most), never starved
])
def test_batch_rides_along_with_interactive_as_often_as_the_slowdown_allows(slowdown, mixed_s,
                                                                             every):
    took = _duty_cycle(slowdown, mixed_s)
    expected = (len(took) - 3, len(took) - 2) if every == 1 else (len(took) // every,
                                                                  len(took) // every + 1)
    assert sum(took) in expected, took


def test_the_duty_cycle_is_off_without_a_slowdown():
    assert all(_duty_cycle(0.0, 0.500)) and all(_duty_cycle(1.5, 0.500, max_skipped=0))
