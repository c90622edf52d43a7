"""How long a step takes for what it holds: an online fit the scheduler plans step width with.

A step cannot be interrupted, so an interactive request that arrives while a wide batch step
runs waits for all of it, and an interactive decode shares its step with whatever batch work
rides along. Capping batch work by *predicted time* rather than by a fixed token count keeps
both bounded on any device: the same 64 tokens are ~10 ms on a GPU and ~150 ms on one CPU
thread, and one decode token at a 2,000-token context reads ~90 MB of fp32 KV cache for this
model, several times the cost of a short-context one.

The model: step_s = fixed + per_token * tokens + per_kkey * (keys attended / 1000), fitted by
least squares with exponential forgetting, so it follows load changes (another process taking a
core) within a few dozen steps. Live traffic alone cannot tell the three terms apart (its steps
look alike: the fit then puts a 10 ms step's cost into a 40 ms "fixed" term and finds batch
work nearly free), so a calibration at start-up (EngineCore.calibrate: short and long
contexts, one and many sequences, prefill chunks) is kept as permanent pseudo-observations
that anchor the split while recent steps set the level. Until it has seen enough steps it says
nothing and the token caps alone apply.
"""
from __future__ import annotations

# Three terms: the normal equations are 3x3 and kept in plain floats. With numpy, observe() and
# the re-fit after it took 77 us per step (0.05 M small-array calls), 1.5% of a batch-1 decode
# step on a 2-core Zen 3; in floats 24 us, the same coefficients (tests).
_N = 3


def keys_attended(start: int, num_tokens: int) -> int:
    """Keys the attention of `num_tokens` new tokens reads when `start` are already cached:
    token i (0-based) attends to start + i + 1 keys."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class StepCostModel:
    def __init__(self, decay: float = 0.97, min_steps: int = 8, ridge: float = 1e-6) -> None:
        if not 0 < decay < 1:
            raise ValueError("decay must be in (0, 1)")
        self.decay = decay
        self.min_steps = min_steps
        self.ridge = ridge
        self.num_steps = 0
        self._xtx = [[0.0] * _N for _ in range(_N)]
        self._xty = [0.0] * _N
        self._anchor_xtx = [[0.0] * _N for _ in range(_N)]   # calibration steps, never forgotten
        self._anchor_xty = [0.0] * _N
        self.anchor_weight = 0.5
        self.calibrating = False
        self._coef: tuple[float, float, float] | None = None

    def observe(self, num_tokens: int, num_keys: int, step_s: float) -> None:
        if num_tokens <= 0 or step_s <= 0:
            return
        x = (1.0, float(num_tokens), num_keys / 1000.0)
        d = self.decay
        for i, row in enumerate(self._xtx):
            xi = x[i]
            for j in range(_N):
                row[j] = d * row[j] + xi * x[j]
            self._xty[i] = d * self._xty[i] + xi * step_s
        if self.calibrating:
            for i, row in enumerate(self._anchor_xtx):
                for j in range(_N):
                    row[j] += x[i] * x[j]
                self._anchor_xty[i] += x[i] * step_s
        self.num_steps += 1
        self._coef = None

    @property
    def ready(self) -> bool:
        return self.num_steps >= self.min_steps and self.coefficients() is not None

    def coefficients(self) -> tuple[float, float, float] | None:
        """(fixed s, s per token, s per 1000 keys attended); None while unknown."""
        if self._coef is None and self.num_steps >= self.min_steps:
            w = self.anchor_weight
            a = [[r[j] + w * q[j] for j in range(_N)] for r, q in zip(self._xtx, self._anchor_xtx)]
            b = [y + w * q for y, q in zip(self._xty, self._anchor_xty)]
            ridge = self.ridge * max(1.0, (a[0][0] + a[1][1] + a[2][2]) / 3)
            for i in range(_N):
                a[i][i] += ridge
            solution = _solve(a, b)
            if solution is None:
                return None
            fixed, per_token, per_kkey = solution
            if per_token <= 0 and per_kkey <= 0:
                # Steps all alike: no way to split the time, so all of it is per token.
                mean_tokens = self._xtx[0][1] / self._xtx[0][0]
                per_token, fixed, per_kkey = self._xty[0] / self._xtx[0][0] / mean_tokens, 0, 0
            self._coef = (max(0.0, float(fixed)), max(0.0, float(per_token)),
                          max(0.0, float(per_kkey)))
        return self._coef

    def predict(self, num_tokens: int, num_keys: int) -> float:
        c = self.coefficients() or (0.0, 0.0, 0.0)
        return c[0] + c[1] * num_tokens + c[2] * num_keys / 1000.0

    def cost(self, start: int, num_tokens: int) -> float:
        """Marginal seconds one request's `num_tokens` at offset `start` add to a step."""
        c = self.coefficients() or (0.0, 0.0, 0.0)
        return c[1] * num_tokens + c[2] * keys_attended(start, num_tokens) / 1000.0

    def tokens_within(self, start: int, seconds: float) -> int:
        """The most tokens a request at offset `start` can add within `seconds`."""
        c = self.coefficients()
        if c is None or seconds <= 0:
            return 0
        _, a, b = c
        b /= 1000.0
        # b/2 n^2 + (a + b (start + 1/2)) n <= seconds
        lin = a + b * (start + 0.5)
        if b <= 0:
            return int(seconds / lin + 1e-9) if lin > 0 else 1 << 30
        return max(0, int((-lin + (lin * lin + 2 * b * seconds) ** 0.5) / b + 1e-9))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b (Gaussian elimination, partial pivoting; a and b are overwritten);
    None when a is singular."""
    n = len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for c in range(col, n):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (b[r] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x
