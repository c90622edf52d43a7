"""What-if: the seed's case study as a golden test, token weighting, infeasibility, scenarios."""
from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest

from costd.pricebook import PriceBook
from costd.whatif.curve import load_curves, parse_curve
from costd.whatif.model import what_if
from costd.whatif.planner import WhatIfPlanner
from costd.whatif.profile import Lengths, Scenario, TrafficProfile

REPO = Path(__file__).resolve().parents[2]
CENT = Decimal("0.01")


def curve(points, device="a100", quantization="none", **extra):
    return parse_curve(json.dumps({"format": "llmmesh.throughput-curve/v1", "name": "test",
                                   "device_type": device, "quantization": quantization,
                                   "points": points, **extra}))


def steady(tokens_per_s: float, hours: int = 24, prompt=500, completion=500) -> TrafficProfile:
    """Demand of exactly `tokens_per_s`, every hour."""
    rps = tokens_per_s / (prompt + completion)
    return TrafficProfile((rps,) * hours, Lengths.of(prompt), Lengths.of(completion))


@pytest.mark.parametrize("tokens_per_s, dollars", [(600, "1.85"), (3000, "0.37"),
                                                   (2000, "0.56")])
def test_seed_case_study_cost_per_million_tokens(tokens_per_s, dollars):
    # The seed: cost per token = $4/h / (throughput × 3600); a device kept busy all day.
    result = what_if(steady(tokens_per_s), Scenario("a100"),
                     curve([{"concurrency": 32, "tokens_per_s": tokens_per_s}]), Decimal("4"))
    assert result.feasible and result.devices_needed == 1
    assert result.utilisation == pytest.approx(1.0)
    assert result.cost_per_million_tokens.quantize(CENT) == Decimal(dollars)
    assert result.cost_per_million_tokens_at_full_utilisation.quantize(CENT) == Decimal(dollars)
    assert result.cost == Decimal("96")  # 24 A100-hours at $4


def test_one_gpu_at_600_tok_s_cannot_carry_200m_tokens_a_day():
    result = what_if(steady(200e6 / 86400), Scenario("a100", max_devices=1),
                     curve([{"concurrency": 32, "tokens_per_s": 600}]), Decimal("4"))
    assert not result.feasible
    assert result.devices_needed == 4  # 2,315 tok/s needs ceil(2315 / 600) devices
    assert "needs 4 devices" in result.reasons[0] and "only 1 available" in result.reasons[0]
    # With the devices it needs, it is feasible.
    assert what_if(steady(200e6 / 86400), Scenario("a100", max_devices=4),
                   curve([{"concurrency": 32, "tokens_per_s": 600}]), Decimal("4")).feasible


def test_periods_weigh_by_tokens_not_a_plain_average_of_hourly_rates():
    # 23 quiet hours at 60 tok/s and one busy hour at 600 tok/s on an autoscaled single device:
    # each hour costs $4, so hourly rates are $18.52 (quiet) and $1.85 (busy) per 1M tokens.
    rps = [0.06] * 23 + [0.6]
    profile = TrafficProfile(tuple(rps), Lengths.of(500), Lengths.of(500))
    result = what_if(profile, Scenario("a100", autoscale=True),
                     curve([{"concurrency": 8, "tokens_per_s": 600}]), Decimal("4"))
    tokens = (23 * 60 + 600) * 3600
    assert result.cost_per_million_tokens == (Decimal(96) * 10**6 / tokens).quantize(
        Decimal("0.000001"))
    plain_average = (23 * 4 / (60 * 3600) + 4 / (600 * 3600)) / 24 * 1e6
    assert float(result.cost_per_million_tokens) == pytest.approx(13.468, abs=1e-3)
    assert plain_average == pytest.approx(17.824, abs=1e-3)  # what a naive average claims


def test_autoscaling_follows_demand_a_fixed_fleet_runs_the_peak_all_day():
    rps = [0.6] * 12 + [1.8] * 12  # 600 then 1,800 tok/s
    profile = TrafficProfile(tuple(rps), Lengths.of(500), Lengths.of(500))
    c = curve([{"concurrency": 8, "tokens_per_s": 600}])
    fixed = what_if(profile, Scenario("a100"), c, Decimal("4"))
    scaled = what_if(profile, Scenario("a100", autoscale=True), c, Decimal("4"))
    assert (fixed.devices_needed, fixed.device_hours, fixed.cost) == (3, 72, Decimal("288"))
    assert (scaled.device_hours, scaled.cost) == (48, Decimal("192"))
    assert fixed.utilisation == pytest.approx(48 / 72)


def test_prompt_and_completion_are_priced_by_their_device_time():
    c = curve([{"concurrency": 4, "prefill_tokens_per_s": 4000, "decode_tokens_per_s": 400}])
    result = what_if(steady(400, prompt=400, completion=400), Scenario("a100"), c,
                     Decimal("3.6"))
    # Per request: 0.1 s prefill + 1 s decode; completion tokens cost 10× prompt tokens.
    ratio = result.completion_cost_per_million_tokens / result.prompt_cost_per_million_tokens
    assert ratio == pytest.approx(10, rel=1e-4)  # rates are rounded to 1e-6


def test_shorter_prompts_and_prefix_hits_lower_the_cost():
    c = curve([{"concurrency": 4, "prefill_tokens_per_s": 1000, "decode_tokens_per_s": 100}])
    base = TrafficProfile((1.0,), Lengths.of(1000), Lengths.of(100))
    cached = TrafficProfile((1.0,), Lengths.of(1000), Lengths.of(100), prefix_hit_rate=0.5)
    floor = lambda p, s: what_if(p, s, c, Decimal(4)).cost_per_million_tokens_at_full_utilisation
    # device s per request: 1 + 1 = 2 → 1100 tok per 2 s; halved prefill → 1100 per 1.5 s.
    assert floor(base, Scenario("a100")) > floor(cached, Scenario("a100"))
    shorter = floor(base, Scenario("a100", prompt_length_change_pct=-50))
    assert shorter == (Decimal(4) / Decimal(3600) / Decimal(600 / 1.5) * 10**6).quantize(
        Decimal("0.000001"))


def test_max_batch_caps_concurrency_and_is_never_extrapolated():
    c = curve([{"concurrency": 1, "tokens_per_s": 100}, {"concurrency": 8, "tokens_per_s": 800}])
    assert what_if(steady(100), Scenario("a100", max_batch=4), c, Decimal(4)).concurrency == 4
    assert what_if(steady(100), Scenario("a100", max_batch=4), c,
                   Decimal(4)).tokens_per_s_per_device == pytest.approx(400)
    beyond = what_if(steady(100), Scenario("a100", max_batch=64), c, Decimal(4))
    assert beyond.concurrency == 8 and "not extrapolated" in beyond.reasons[0]


def test_latency_target_picks_the_largest_batch_that_meets_it():
    c = curve([{"concurrency": 1, "tokens_per_s": 100, "p95_ttft_s": 0.1, "p95_tpot_s": 0.01},
               {"concurrency": 8, "tokens_per_s": 400, "p95_ttft_s": 0.5, "p95_tpot_s": 0.05}])
    profile = TrafficProfile((0.1,), Lengths.of(100), Lengths.of(20))
    result = what_if(profile, Scenario("a100", p95_latency_slo_s=1.0), c, Decimal(4))
    assert result.feasible and result.p95_latency_s <= 1.0
    assert 1 < result.concurrency < 8
    impossible = what_if(profile, Scenario("a100", p95_latency_slo_s=0.01), c, Decimal(4))
    assert not impossible.feasible and "no concurrency meets" in impossible.reasons[0]


def test_shipped_cpu_curve_and_planner_pick_curve_and_price():
    curves = load_curves(REPO / "bench" / "curves")
    assert any(c.device_type == "cpu" for c in curves)
    planner = WhatIfPlanner(PriceBook.load(REPO / "config" / "prices.toml"), curves)
    profile = TrafficProfile((0.5,) * 24, Lengths(((128.0, 3.0), (512.0, 1.0))), Lengths.of(64))
    result = planner.answer(profile, Scenario("cpu"))
    assert result.feasible and result.devices_needed >= 1
    assert result.cost == Decimal("0.10") * result.device_hours  # the book's cpu price
    with pytest.raises(ValueError, match="no throughput curve for device 'h100'"):
        planner.answer(profile, Scenario("h100"))


@pytest.mark.parametrize("document, message", [
    ({"format": "other", "device_type": "cpu", "points": []}, "format must be"),
    ({"format": "llmmesh.throughput-curve/v1", "device_type": "cpu", "points": []}, "no points"),
    ({"format": "llmmesh.throughput-curve/v1", "device_type": "cpu",
      "points": [{"concurrency": 2, "tokens_per_s": 1}, {"concurrency": 1, "tokens_per_s": 1}]},
     "sorted"),
    ({"format": "llmmesh.throughput-curve/v1", "device_type": "cpu",
      "points": [{"concurrency": 1, "tokens_per_s": 0}]}, "must be > 0"),
])
def test_bad_curves_are_refused(document, message):
    with pytest.raises(ValueError, match=message):
        parse_curve(json.dumps(document))


@pytest.mark.parametrize("kwargs, message", [
    (dict(device=""), "device is required"), (dict(device="a", target_utilisation=0),
                                              "target_utilisation"),
    (dict(device="a", prompt_length_change_pct=-100), "prompt_length_change_pct"),
])
def test_bad_scenarios_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Scenario(**kwargs)


def test_length_distribution_mean_and_p95():
    lengths = Lengths(((100.0, 90.0), (1000.0, 10.0)))
    assert lengths.mean == pytest.approx(190)
    assert lengths.p95 == 1000
