"""The step-time model the scheduler uses to keep batch work in a step short."""
from __future__ import annotations

import pytest

from workers.engine.step_cost import StepCostModel, keys_attended


def test_keys_attended_counts_each_new_tokens_causal_context():
    assert keys_attended(0, 1) == 1
    assert keys_attended(0, 4) == 1 + 2 + 3 + 4
    assert keys_attended(100, 1) == 101                  # a decode at context 100
    assert keys_attended(10, 3) == 11 + 12 + 13


def _truth(tokens, keys):
    return 0.004 + 0.002 * tokens + 0.0005 * keys / 1000


def test_fits_fixed_per_token_and_per_key_cost():
    model = StepCostModel()
    shapes = [(1, 50), (8, 9000), (16, 2000), (32, 600), (64, 40000), (4, 30000), (1, 2000),
              (48, 1200), (2, 100), (24, 24000)]
    for tokens, keys in shapes * 3:
        model.observe(tokens, keys, _truth(tokens, keys))
    fixed, per_token, per_kkey = model.coefficients()
    assert fixed == pytest.approx(0.004, rel=1e-3)
    assert per_token == pytest.approx(0.002, rel=1e-3)
    assert per_kkey == pytest.approx(0.0005, rel=1e-3)
    # A decode at a 2,000-token context costs 2 ms + 1 ms of attention.
    assert model.cost(2000, 1) == pytest.approx(0.002 + 0.0005 * 2.001, rel=1e-3)
    # 20 ms at offset 0: b/2 n^2 + (a + b/2) n <= 0.02 with a = 2 ms, b = 0.5 us: n = 9.
    assert model.tokens_within(0, 0.020) == 9
    # Far into a long prompt each token also reads its context: fewer fit.
    assert model.tokens_within(8000, 0.020) == 3
    assert model.tokens_within(0, 0.0) == 0


def test_says_nothing_before_enough_steps_and_follows_a_slowdown():
    model = StepCostModel(min_steps=8)
    for n in (4, 8, 16):
        model.observe(n, n * 100, 0.001 * n)
    assert not model.ready and model.coefficients() is None
    assert model.tokens_within(0, 0.05) == 0
    for _ in range(20):
        for n in (4, 8, 16):
            model.observe(n, n * 100, 0.001 * n)
    fast = model.tokens_within(0, 0.05)
    for _ in range(60):                                  # another process now takes half the core
        for n in (4, 8, 16):
            model.observe(n, n * 100, 0.002 * n)
    slow = model.tokens_within(0, 0.05)
    assert fast == pytest.approx(50, abs=3) and slow == pytest.approx(25, abs=2)


def test_fit_equals_weighted_least_squares_with_anchor_and_forgetting():
    """The plain-float normal equations give numpy's weighted least-squares answer: decayed
    live steps plus the calibration steps at their anchor weight, with the small ridge."""
    import random

    import numpy as np
    rng = random.Random(7)
    model = StepCostModel(decay=0.9)
    rows, weights, ys = [], [], []
    model.calibrating = True
    for _ in range(6):
        t, k, s = rng.randint(1, 64), rng.randint(0, 30000), rng.uniform(0.002, 0.2)
        model.observe(t, k, s)
        rows.append((1.0, t, k / 1000)), ys.append(s), weights.append(("anchor", len(rows)))
    model.calibrating = False
    for _ in range(40):
        t, k, s = rng.randint(1, 64), rng.randint(0, 30000), rng.uniform(0.002, 0.2)
        model.observe(t, k, s)
        rows.append((1.0, t, k / 1000)), ys.append(s), weights.append(("live", len(rows)))
    n = len(rows)
    x, y = np.array(rows), np.array(ys)
    # Weight of step i: decay^(steps after it); calibration steps also count at anchor weight.
    w = np.array([0.9 ** (n - i) + (model.anchor_weight if kind == "anchor" else 0.0)
                  for kind, i in weights])
    xtx = (x * w[:, None]).T @ x
    expected = np.linalg.solve(xtx + model.ridge * np.eye(3) * max(1.0, np.trace(xtx) / 3),
                               (x * w[:, None]).T @ y)
    expected = np.maximum(expected, 0.0)
    assert model.coefficients() == pytest.approx(tuple(expected), rel=1e-9, abs=1e-15)
