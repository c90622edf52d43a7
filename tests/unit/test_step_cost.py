"""The step-time model the scheduler uses to keep batch steps short."""
from __future__ import annotations

import pytest

from workers.engine.step_cost import StepCostModel


def test_fits_fixed_and_per_token_cost_and_answers_a_budget():
    model = StepCostModel()
    for n in (1, 8, 16, 32, 64, 8, 1, 48):
        model.observe(n, 0.004 + 0.002 * n)
    fixed, per_token = model.line()
    assert fixed == pytest.approx(0.004, rel=1e-6)
    assert per_token == pytest.approx(0.002, rel=1e-6)
    assert model.tokens_within(0.050) == 23          # (50 - 4) / 2
    assert model.tokens_within(0.003) == 0           # the fixed cost alone is over budget


def test_says_nothing_before_enough_steps_and_follows_a_slowdown():
    model = StepCostModel(min_steps=8)
    for n in (4, 8, 16):
        model.observe(n, 0.001 * n)
    assert model.tokens_within(0.05) is None
    for _ in range(10):
        for n in (4, 8, 16):
            model.observe(n, 0.001 * n)
    fast = model.tokens_within(0.05)
    for _ in range(40):                               # another process now takes half the core
        for n in (4, 8, 16):
            model.observe(n, 0.002 * n)
    slow = model.tokens_within(0.05)
    assert fast == pytest.approx(50, abs=2) and slow == pytest.approx(25, abs=2)


def test_same_size_steps_are_read_as_all_per_token():
    model = StepCostModel()
    for _ in range(10):
        model.observe(16, 0.032)
    assert model.line() == pytest.approx((0.0, 0.002))
    assert model.tokens_within(0.05) == 25
