"""Worker-selection policies: exact choices for hand-built fleets."""
from __future__ import annotations

from llmmesh.prefix_hash import block_hashes
from llmmesh.queue import QueueEntry
from router.policy import LeastLoad, PrefixAffinity, RoundRobin, make_policy
from router.registry import WorkerHandle


def worker(wid, inflight=0, cached=(), max_inflight=10):
    return WorkerHandle(worker_id=wid, address="", max_inflight=max_inflight, channel=None, stub=None,
                        num_inflight=inflight, cached_hashes=frozenset(cached))


def entry(tokens, salt="scope:a"):
    return QueueEntry(request_id="r", tenant_id="t", request_class="interactive", model="m",
                      prompt_token_ids=tokens, sampling={}, cache_salt=salt,
                      block_hashes=block_hashes(tokens, 4, salt))


def test_affinity_prefers_longest_cached_run():
    e = entry(list(range(16)))  # 4 blocks
    a = worker("a", cached=e.block_hashes[:1])
    b = worker("b", inflight=1, cached=e.block_hashes[:3])
    c = worker("c")
    assert PrefixAffinity(max_load_gap=0.5).select_worker(e, [a, b, c]) is b


def test_affinity_needs_the_run_from_the_first_block():
    e = entry(list(range(16)))
    a = worker("a", inflight=2, cached=e.block_hashes[1:])  # a hole at block 0 is no hit
    b = worker("b")
    assert PrefixAffinity().select_worker(e, [a, b]) is b


def test_affinity_yields_to_load_beyond_the_margin():
    e = entry(list(range(16)))
    hot = worker("hot", inflight=8, cached=e.block_hashes)
    idle = worker("idle", inflight=1)
    assert PrefixAffinity(max_load_gap=0.25).select_worker(e, [hot, idle]) is idle
    assert PrefixAffinity(max_load_gap=0.8).select_worker(e, [hot, idle]) is hot


def test_other_tenant_scope_gets_no_affinity():
    mine = entry(list(range(16)), salt="scope:a")
    theirs = entry(list(range(16)), salt="scope:b")
    a = worker("a", inflight=1, cached=mine.block_hashes)
    b = worker("b")
    assert PrefixAffinity().select_worker(mine, [a, b]) is a
    assert PrefixAffinity().select_worker(theirs, [a, b]) is b  # same tokens, other scope


def test_dispatch_hint_counts_until_the_worker_reports():
    e = entry(list(range(16)))
    a, b = worker("a"), worker("b")
    p = PrefixAffinity()
    first = p.select_worker(e, [a, b])
    p.on_dispatched(e, first)
    first.num_inflight += 1
    assert p.select_worker(e, [a, b]) is first


def test_least_load_and_round_robin():
    ws = [worker("a", 3), worker("b", 1), worker("c", 2)]
    assert LeastLoad().select_worker(entry([1]), ws).worker_id == "b"
    rr = RoundRobin()
    assert [rr.select_worker(entry([1]), ws).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    assert make_policy("least-load").name == "least-load"
    assert LeastLoad().select_worker(entry([1]), []) is None


def test_a_cooled_down_open_circuit_gets_the_next_request_as_its_probe():
    """Prefix affinity sends a shared system prompt to the worker that cached it, so a worker
    whose circuit opened was never picked again and its circuit never closed (CI's F6 run: both
    routers still open 30 s after SIGCONT). Once its cool-down is over, the next request goes
    there as the probe; before that, and for the request after the probe, affinity decides."""
    from router.breaker import CircuitBreaker, CircuitState
    from router.policy import place

    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    clock = Clock()
    e = entry(list(range(16)))
    cached = worker("cached", cached=e.block_hashes)
    stopped = worker("stopped")
    for h in (cached, stopped):
        h.lease_models = ({"name": "m", "state": "loaded"},)
        h.breaker = CircuitBreaker(h.worker_id, failure_threshold=1, open_s=5, clock=clock)
    stopped.breaker.on_failure()
    fleet = [cached, stopped]
    policy = PrefixAffinity()
    clock.now = 4.0      # cooling down: not available, affinity's pick
    assert place(policy, e, [h for h in fleet if h.free_slots], fleet, 0.0) is cached
    clock.now = 5.5      # cooled down: the probe goes there although the prefix is elsewhere
    assert place(policy, e, [h for h in fleet if h.free_slots], fleet, 0.0) is stopped
    assert stopped.breaker.on_dispatch() and stopped.breaker.state is CircuitState.HALF_OPEN
    # While the probe runs, the next request follows affinity again.
    assert place(policy, e, [h for h in fleet if h.free_slots], fleet, 0.0) is cached
    stopped.breaker.on_success()
    assert place(policy, e, [h for h in fleet if h.free_slots], fleet, 0.0) is cached
