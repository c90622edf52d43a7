"""How long a step takes for how many tokens: an online fit the scheduler plans step width with.

A step cannot be interrupted, so an interactive request that arrives while a wide batch step
runs waits for all of it. Capping batch work by *time* rather than by a fixed token count keeps
that wait bounded on any device: the same cap in tokens is ~10 ms on a GPU and ~150 ms on one
CPU thread. The model is a line, step_s = fixed + per_token * tokens, fitted by least squares
with exponential forgetting so it follows load changes (another process taking a core, a
longer context) within a few dozen steps.
"""
from __future__ import annotations


class StepCostModel:
    def __init__(self, decay: float = 0.95, min_steps: int = 8) -> None:
        if not 0 < decay < 1:
            raise ValueError("decay must be in (0, 1)")
        self.decay = decay
        self.min_steps = min_steps
        self.num_steps = 0
        # Exponentially weighted sums for the least-squares line.
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, num_tokens: int, step_s: float) -> None:
        if num_tokens <= 0 or step_s <= 0:
            return
        d = self.decay
        x, y = float(num_tokens), step_s
        self._w = d * self._w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + y
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * y
        self.num_steps += 1

    @property
    def ready(self) -> bool:
        return self.num_steps >= self.min_steps

    def line(self) -> tuple[float, float]:
        """(fixed seconds per step, seconds per token). With too little spread in step sizes
        to separate the two, all of the time is treated as per-token (the cautious reading)."""
        w = self._w
        if w <= 0:
            return 0.0, 0.0
        mean_x, mean_y = self._x / w, self._y / w
        var = self._xx / w - mean_x * mean_x
        if var < 1.0:
            return 0.0, mean_y / max(mean_x, 1.0)
        slope = (self._xy / w - mean_x * mean_y) / var
        if slope <= 0:
            return 0.0, mean_y / max(mean_x, 1.0)
        fixed = max(0.0, mean_y - slope * mean_x)
        return fixed, slope

    def predict(self, num_tokens: int) -> float:
        fixed, per_token = self.line()
        return fixed + per_token * num_tokens

    def tokens_within(self, budget_s: float) -> int | None:
        """The most tokens a step can hold and still end within budget_s; None before the
        model has seen enough steps to say."""
        if not self.ready:
            return None
        fixed, per_token = self.line()
        if per_token <= 0:
            return None
        return max(0, int((budget_s - fixed) / per_token + 1e-6))
