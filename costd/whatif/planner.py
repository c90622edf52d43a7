"""Answers a what-if: picks the curve and the price for a scenario, then runs the model
(one model: model.py; several sharing devices: consolidation.py)."""
from __future__ import annotations

import time
from collections.abc import Sequence
from decimal import Decimal

from costd.pricebook import PriceBook
from costd.whatif.curve import ThroughputCurve, parse_curve
from costd.whatif.consolidation import ConsolidationResult, FieldError, ModelLoad, consolidate
from costd.whatif.model import WhatIfResult, what_if
from costd.whatif.profile import Scenario, TrafficProfile


class WhatIfPlanner:
    def __init__(self, book: PriceBook, curves: Sequence[ThroughputCurve]) -> None:
        self.book = book
        self.curves = tuple(curves)

    def _device(self, device_type: str) -> str:
        return self.book.device_for(device_type) or device_type

    def curve_for(self, scenario: Scenario) -> ThroughputCurve:
        device = self._device(scenario.device)
        matches = [c for c in self.curves if self._device(c.device_type) == device
                   and (not scenario.quantization or c.quantization == scenario.quantization)]
        if not matches:
            known = ", ".join(f"{c.name} ({c.device_type}, {c.quantization or 'any'})"
                              for c in self.curves) or "none"
            raise ValueError(f"no throughput curve for device {scenario.device!r} "
                             f"quantization {scenario.quantization or 'any'!r}; known: {known}")
        return matches[0]

    def price_for(self, scenario: Scenario) -> Decimal:
        if scenario.price_per_hour is not None:
            return scenario.price_per_hour
        price = self.book.price(self._device(scenario.device), time.time_ns())
        if price is None:
            raise ValueError(f"device {scenario.device!r} has no price in the price book; "
                             "give scenario.price_per_hour")
        return price.per_hour

    def answer(self, profile: TrafficProfile, scenario: Scenario,
               curve_json: str = "") -> WhatIfResult:
        """Raises ValueError naming what is wrong with the question."""
        curve = parse_curve(curve_json) if curve_json else self.curve_for(scenario)
        return what_if(profile, scenario, curve, self.price_for(scenario))

    def curve_named(self, name: str) -> ThroughputCurve:
        for curve in self.curves:
            if curve.name == name:
                return curve
        known = ", ".join(c.name for c in self.curves) or "none"
        raise ValueError(f"no throughput curve named {name!r}; known: {known}")

    def consolidate(self, models: Sequence[ModelLoad], scenario: Scenario,
                    device_memory_mib: float) -> ConsolidationResult:
        """Raises FieldError naming what is wrong with the question."""
        device = self._device(scenario.device)
        for i, m in enumerate(models):
            if self._device(m.curve.device_type) != device:
                raise FieldError(f"models[{i}].curve", f"{m.curve.name} was measured on "
                                 f"{m.curve.device_type}, not {scenario.device}")
        try:
            price = self.price_for(scenario)
        except ValueError as error:
            raise FieldError("scenario.price_per_hour", str(error)) from error
        return consolidate(models, scenario, price, device_memory_mib)
