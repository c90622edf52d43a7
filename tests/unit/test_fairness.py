"""Deficit round robin over tenants and the class policy, with exact orders."""
from __future__ import annotations

from router.fairness import ClassPolicy, ClassScheduler, DeficitRoundRobin


def drain(drr):
    out = []
    while (item := drr.pop()) is not None:
        out.append(item)
    return out


def test_drr_shares_tokens_not_requests():
    drr = DeficitRoundRobin[str](quantum=100)
    for i in range(4):
        drr.push("big", f"big{i}", 200)      # heavy requests
    for i in range(8):
        drr.push("small", f"small{i}", 50)   # light requests
    order = drain(drr)
    # Each round grants 100 tokens: 'big' runs one 200-token request every second round
    # while 'small' runs two 50-token requests per round: equal tokens, not equal requests.
    assert order[:6] == ["small0", "small1", "big0", "small2", "small3", "small4"]
    tokens = {"big": 0, "small": 0}
    for item in order[:9]:
        tokens["big" if item.startswith("big") else "small"] += 200 if item.startswith("big") else 50
    assert abs(tokens["big"] - tokens["small"]) <= 200
    assert len(order) == 12 and len(drr) == 0


def test_drr_flooding_tenant_cannot_delay_a_quiet_one():
    drr = DeficitRoundRobin[str](quantum=64)
    for i in range(1000):
        drr.push("flood", f"f{i}", 64)
    drr.push("quiet", "q0", 64)
    order = drain(drr)
    assert order.index("q0") <= 1  # served in the first round, not after 1000 flood requests


def test_drr_idle_tenant_keeps_no_credit():
    drr = DeficitRoundRobin[str](quantum=1000)
    drr.push("a", "a0", 10)
    assert drr.pop() == "a0"
    assert drr.tenants() == []  # its 990 leftover tokens are gone
    drr.push("b", "b0", 10)
    drr.push("a", "a1", 10)
    assert drain(drr) == ["b0", "a1"]


def test_drr_remove_takes_out_that_item_alone_and_an_emptied_tenant_with_its_credit():
    drr = DeficitRoundRobin[str](quantum=100)
    for item in ("a0", "a1", "a2"):
        drr.push("a", item, 10)
    drr.push("b", "b0", 10)
    assert drr.remove("a", "a1") and len(drr) == 3
    assert not drr.remove("a", "a1") and not drr.remove("c", "a0")   # not (or no longer) there
    assert drr.remove("b", "b0") and drr.tenants() == ["a"]
    assert drain(drr) == ["a0", "a2"]


def test_interactive_first_and_batch_never_starves():
    sched = ClassScheduler[str](ClassPolicy(batch_min_share=0.25, batch_max_slot_share=1.0, window=8))
    for i in range(40):
        sched.push("interactive", "t", f"i{i}", 10)
    for i in range(10):
        sched.push("batch", "t", f"b{i}", 10)
    picks = [sched.pop(free_slots=1, total_slots=100, batch_inflight=0)[0] for _ in range(40)]
    assert picks[0] == "interactive"
    share = picks.count("batch") / len(picks)
    assert 0.2 <= share <= 0.3, picks  # the guard holds batch at its floor, no more


def test_no_batch_share_guard_means_interactive_strictly_first():
    sched = ClassScheduler[str](ClassPolicy(batch_min_share=0.0, batch_max_slot_share=1.0))
    for i in range(5):
        sched.push("batch", "t", f"b{i}", 10)
        sched.push("interactive", "t", f"i{i}", 10)
    picks = [sched.pop(1, 10, 0)[1] for _ in range(10)]
    assert picks == [f"i{i}" for i in range(5)] + [f"b{i}" for i in range(5)]


def test_batch_capped_below_the_fleet_so_interactive_finds_room():
    sched = ClassScheduler[str](ClassPolicy(batch_min_share=0.0, batch_max_slot_share=0.5))
    sched.push("batch", "t", "b0", 10)
    assert sched.pop(free_slots=6, total_slots=10, batch_inflight=5) is None  # batch at its cap
    sched.push("interactive", "t", "i0", 10)
    assert sched.pop(free_slots=5, total_slots=10, batch_inflight=5) == ("interactive", "i0")
    assert sched.pop(free_slots=5, total_slots=10, batch_inflight=4) == ("batch", "b0")
    assert sched.pop(free_slots=0, total_slots=10, batch_inflight=0) is None


def test_ready_says_exactly_when_pop_would_hand_something_out():
    """The router blocks on Redis only when nothing held can go (no busy loop over held batch
    work that waits for its share of the slots)."""
    sched = ClassScheduler[str](ClassPolicy(batch_min_share=0.0, batch_max_slot_share=0.5))
    assert not sched.ready(free_slots=10, total_slots=10, batch_inflight=0)   # nothing held
    sched.push("batch", "t", "b0", 10)
    assert not sched.ready(free_slots=5, total_slots=10, batch_inflight=5)    # batch at its cap
    assert not sched.ready(free_slots=0, total_slots=10, batch_inflight=0)    # no slots
    assert sched.ready(free_slots=5, total_slots=10, batch_inflight=4)
    sched.push("interactive", "t", "i0", 10)
    assert sched.ready(free_slots=5, total_slots=10, batch_inflight=5)
    for free, inflight in ((5, 5), (5, 4), (0, 0), (10, 0)):
        state = sched.ready(free, 10, inflight)
        got = sched.pop(free, 10, inflight)
        assert state == (got is not None)
        if got is not None:
            sched.push(got[0], "t", got[1], 10)


def test_interactive_goes_past_the_slot_cap_to_seats_batch_holds_and_batch_does_not():
    """No free slot (batch fills its share, interactive the rest): an interactive entry still
    goes where it can take a seat from batch (interactive_free), a batch entry never does."""
    sched = ClassScheduler[str](ClassPolicy(batch_min_share=0.0, batch_max_slot_share=0.8))
    sched.push("batch", "t", "b0", 10)
    sched.push("interactive", "t", "i0", 10)
    assert sched.pop(0, 20, 16) is None and not sched.ready(0, 20, 16)   # as before
    assert sched.ready(0, 20, 16, interactive_free=0) is False
    assert sched.ready(0, 20, 16, interactive_free=3)
    assert sched.pop(0, 20, 16, interactive_free=3) == ("interactive", "i0")
    assert sched.pop(0, 20, 15, interactive_free=3) is None    # batch needs a slot
    assert sched.pop(1, 20, 15, interactive_free=3) == ("batch", "b0")
