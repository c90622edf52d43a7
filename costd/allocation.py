"""Splitting an amount into shares that add up to it exactly (largest remainder).

Rounding each share on its own can lose or invent a unit; here the shares always sum to the
total, which is what keeps Σ tenants + idle = Σ capacity × price exact to the last unit.
"""
from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction


def split_units(total: int, weights: Sequence[Fraction | Decimal | int]) -> list[int] | None:
    """`total` integer units shared by weight; None when the weights sum to zero.

    Floors every exact share, then gives the leftover units to the largest remainders (ties to
    the earlier weight, so the answer is deterministic). A negative total is split as its
    opposite, negated.
    """
    weights = [Fraction(w) for w in weights]
    weight_sum = sum(weights, Fraction(0))
    if not weights or weight_sum == 0:
        return None
    if any(w < 0 for w in weights):
        raise ValueError("weights must be >= 0")
    if total < 0:
        return [-share for share in split_units(-total, weights)]  # type: ignore[union-attr]
    exact = [total * w / weight_sum for w in weights]
    shares = [int(e) for e in exact]  # floor: every exact share is >= 0
    leftover = total - sum(shares)
    by_remainder = sorted(range(len(exact)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in by_remainder[:leftover]:
        shares[i] += 1
    return shares


def split_amount(total: Decimal, weights: Sequence[Fraction | Decimal | int],
                 quantum: Decimal) -> list[Decimal] | None:
    """`total` (a multiple of `quantum`) shared by weight, each share a multiple of quantum."""
    units = total / quantum
    if units != units.to_integral_value():
        raise ValueError(f"{total} is not a multiple of {quantum}")
    shares = split_units(int(units), weights)
    return None if shares is None else [quantum * share for share in shares]
