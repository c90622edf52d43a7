"""Consolidation what-if: k models on shared devices vs devices of their own.

Every model here runs on one curve point, 1,000 tok/s for prefill and decode alike, with
500 + 500-token requests: one request is exactly 1 device-second, so a model's busy devices in
an hour equal its requests per second, and the expected numbers below are counted by hand.
"""
from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from pathlib import Path

import grpc
import pytest

from costd import convert
from costd.access import CostAccess
from costd.config import DEFAULT_TENANTS
from costd.pricebook import PriceBook
from costd.service import CostServicer
from costd.whatif.consolidation import FieldError, ModelLoad, consolidate
from costd.whatif.curve import load_curves, parse_curve
from costd.whatif.planner import WhatIfPlanner
from costd.whatif.profile import Lengths, Scenario, TrafficProfile
from llmmesh.apikeys import DEMO_ADMIN_KEY
from llmmesh.errors import InvalidArgument
from llmmesh.server import ErrorMappingInterceptor
from llmmesh.v1 import cost_pb2, cost_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "bench" / "profiles" / "consolidation.json"
PRICE = Decimal(4)
CURVE = {"format": "llmmesh.throughput-curve/v1", "name": "flat", "device_type": "a100",
         "points": [{"concurrency": 8, "tokens_per_s": 1000}]}
ONE_SECOND = parse_curve(json.dumps(CURVE))
HALF, NIGHT, DAY = 12, [0.0] * 12, [0.9] * 12


def profile(rps) -> TrafficProfile:
    return TrafficProfile(tuple(rps), Lengths.of(500), Lengths.of(500))


def model(name, rps, memory_mib=600.0, load_s=60.0, pinned=False) -> ModelLoad:
    return ModelLoad(name, profile(rps), ONE_SECOND, memory_mib, load_s, pinned)


def run(models, memory_mib=2000.0, **scenario):
    return consolidate(models, Scenario("a100", **scenario), PRICE, memory_mib)


# Peaks 12 h apart: 1.5 req/s by day and 0.5 by night, and the other way round.
SWAPPED_PEAKS = [model("a", [1.5] * HALF + [0.5] * HALF), model("b", [0.5] * HALF + [1.5] * HALF)]


def test_peaks_twelve_hours_apart_share_devices_for_half_the_cost():
    result = run(SWAPPED_PEAKS)
    # Dedicated, fixed fleets: each model runs its peak's ⌈1.5⌉ = 2 devices all day.
    assert result.dedicated.devices_by_hour == (4,) * 24
    assert (result.dedicated.device_hours, result.dedicated.cost) == (96, Decimal(384))
    # Shared: 1.5 + 0.5 = 2.0 busy devices every hour → 2 devices.
    assert result.shared.devices_by_hour == (2,) * 24
    assert (result.shared.device_hours, result.shared.cost) == (48, Decimal(192))
    assert (result.saving, result.saving_pct, result.cheaper) == (Decimal(192), 50.0, "shared")
    assert result.shared.utilisation == pytest.approx(1.0)
    assert result.dedicated.utilisation == pytest.approx(0.5)
    # 24 req/s-hours × 3600 × 1000 tokens per model: 172.8M tokens in all.
    assert result.dedicated.cost_per_million_tokens == Decimal("2.222222")
    assert result.shared.cost_per_million_tokens == Decimal("1.111111")
    assert [m.shared_cost for m in result.models] == [Decimal(96), Decimal(96)]
    assert result.shared.loading_s == 0 and result.shared.feasible


def test_peaks_twelve_hours_apart_autoscaled_still_save_the_rounding():
    result = run(SWAPPED_PEAKS, autoscale=True)
    # Dedicated: each model 2 devices for 12 h and 1 for 12 h = 36 device-hours.
    assert result.dedicated.device_hours == 72
    assert result.shared.device_hours == 48
    assert result.saving == Decimal(24 * 4)


def test_two_flat_models_that_each_fill_a_device_save_nothing():
    result = run([model("a", [1.0] * 24), model("b", [1.0] * 24)])
    assert result.dedicated.devices_by_hour == result.shared.devices_by_hour == (2,) * 24
    assert (result.saving, result.cheaper) == (Decimal(0), "equal")


def test_memory_that_holds_both_never_loads():
    result = run([model("a", DAY + NIGHT), model("b", NIGHT + DAY)], memory_mib=1200)
    assert result.shared.loading_s == 0
    assert [m.num_loads for m in result.models] == [0, 0]
    assert all(h.loaded == () for h in result.hours)


def test_memory_that_holds_one_loads_each_model_when_its_day_begins():
    # Steady state of the repeating day: b is resident at midnight (it served 12-23), so a is
    # loaded at hour 0 and b again at hour 12: 2 loads of 60 s on the one device.
    result = run([model("a", DAY + NIGHT), model("b", NIGHT + DAY)], memory_mib=1000)
    assert [h.hour for h in result.hours if h.loaded] == [0, 12]
    assert result.hours[0].loaded == ("a",) and result.hours[12].loaded == ("b",)
    assert result.shared.loading_s == 2 * 60
    assert [(m.num_loads, m.loading_s) for m in result.models] == [(1, 60), (1, 60)]
    # ⌈0.9 / (1 − 60/3600)⌉ = ⌈0.915⌉ = 1 device: loading fits beside the traffic.
    assert result.shared.devices_by_hour == (1,) * 24
    assert result.cheaper == "shared"


def test_both_busy_every_hour_in_memory_for_one_swap_every_hour():
    result = run([model("a", [0.3] * 24), model("b", [0.3] * 24)], memory_mib=1000)
    # Each hour the resident model serves first, then the other is loaded: 24 loads a day.
    assert result.shared.loading_s == 24 * 60
    assert [m.num_loads for m in result.models] == [12, 12]
    assert any("hours 0-23" in r and "take turns" in r for r in result.shared.reasons)
    roomy = run([model("a", [0.3] * 24), model("b", [0.3] * 24)], memory_mib=1200)
    assert roomy.shared.loading_s == 0 and not any("take turns" in r for r in roomy.shared.reasons)


def test_a_huge_load_time_makes_dedicated_devices_cheaper():
    # Loading 3500 s leaves 100 s of a device's hour: ⌈0.9 / (100/3600)⌉ = ⌈32.4⌉ = 33 devices
    # in hours 0 and 12, and a fixed fleet runs 33 all day: 792 device-hours vs 48 dedicated.
    slow = [model("a", DAY + NIGHT, load_s=3500), model("b", NIGHT + DAY, load_s=3500)]
    result = run(slow, memory_mib=1000)
    assert result.shared.devices_by_hour[0] == 33 and result.shared.device_hours == 792
    assert result.dedicated.device_hours == 48
    assert (result.cheaper, result.saving) == ("dedicated", Decimal((48 - 792) * 4))
    assert result.shared.loading_s == 2 * 33 * 3500  # every running device loads
    fast = run([model("a", DAY + NIGHT, load_s=5), model("b", NIGHT + DAY, load_s=5)],
               memory_mib=1000)
    assert fast.cheaper == "shared"


def test_a_load_longer_than_the_hour_is_infeasible_not_a_number():
    endless = [model("a", DAY + NIGHT, load_s=3600), model("b", NIGHT + DAY, load_s=3600)]
    result = run(endless, memory_mib=1000)
    assert not result.shared.feasible and result.dedicated.feasible
    assert (result.saving, result.cheaper) == (None, "dedicated")
    assert any("hour 0 loads a for 3600 s" in r for r in result.shared.reasons)


def test_a_pinned_model_takes_memory_even_without_traffic():
    idle = [0.0] * 24
    busy = [model("b", [0.3] * 24), model("c", [0.3] * 24)]
    pinned = run([model("a", idle, pinned=True), *busy], memory_mib=1300)
    assert pinned.shared.loading_s == 24 * 60  # b and c share 700 MiB: one at a time
    assert pinned.models[0].num_loads == 0
    unpinned = run([model("a", idle), *busy], memory_mib=1300)
    assert unpinned.shared.loading_s == 0  # a is never asked for, so never loaded


def test_a_model_that_does_not_fit_beside_the_pinned_ones_is_named():
    result = run([model("a", [0.3] * 24, pinned=True), model("b", [0.3] * 24)],
                 memory_mib=1000)
    assert not result.shared.feasible and result.cheaper == "dedicated"
    assert any("b needs 600 MiB" in r and "pinned models' 600 MiB" in r and "only 400" in r
               for r in result.shared.reasons)
    assert run([model("a", [0.3] * 24), model("b", [0.3] * 24)], memory_mib=1000).shared.feasible


def test_max_devices_caps_each_layout():
    result = run(SWAPPED_PEAKS, max_devices=3)
    assert not result.dedicated.feasible and result.shared.feasible
    assert "needs 4 devices" in result.dedicated.reasons[-1]


@pytest.mark.parametrize("models, memory_mib, field", [
    ([model("a", [1.0] * 24), model("b", [1.0] * 12)], 2000, r"models\[1\]\.profile"),
    ([model("a", [1.0] * 24, memory_mib=2500)], 2000, r"models\[0\]\.memory_mib"),
    ([model("a", [1.0] * 24), model("a", [1.0] * 24)], 2000, r"models\[1\]\.name"),
    ([], 2000, "models"),
    ([model("a", [1.0] * 24)], 0, "device_memory_mib"),
])
def test_bad_questions_name_the_field(models, memory_mib, field):
    with pytest.raises(ValueError, match=field):
        run(models, memory_mib=memory_mib)


def test_negative_load_time_is_refused():
    with pytest.raises(ValueError, match="load_s: must be >= 0"):
        model("a", [1.0] * 24, load_s=-1)


def planner() -> WhatIfPlanner:
    return WhatIfPlanner(PriceBook.load(REPO / "config" / "prices.toml"),
                         [*load_curves(REPO / "bench" / "curves"), ONE_SECOND])


def test_unknown_curves_and_curves_of_another_device_are_refused():
    with pytest.raises(ValueError, match="no throughput curve named 'nope'"):
        planner().curve_named("nope")
    with pytest.raises(FieldError, match=r"models\[0\]\.curve: flat was measured on a100"):
        planner().consolidate([model("a", [1.0] * 24)], Scenario("cpu"), 2000)


def proto_model(name: str, curve: str = "flat", load_s: float = 60) -> cost_pb2.ConsolidationModel:
    return cost_pb2.ConsolidationModel(
        name=name, curve=curve, memory_mib=600, load_s=load_s,
        profile=cost_pb2.TrafficProfile(
            requests_per_s_by_hour=[1.0] * 24,
            prompt_tokens=[cost_pb2.LengthBucket(tokens=500, weight=1)],
            completion_tokens=[cost_pb2.LengthBucket(tokens=500, weight=1)]))


@pytest.mark.parametrize("bad, field", [(proto_model("b", curve="nope"), "models[1].curve"),
                                        (proto_model("b", load_s=-1), "models[1].load_s")])
def test_proto_models_name_the_bad_field(bad, field):
    with pytest.raises(InvalidArgument) as caught:
        convert.consolidation_models([proto_model("a"), bad], planner().curve_named)
    assert caught.value.field == field


ADMIN_AUTH = (("authorization", f"Bearer {DEMO_ADMIN_KEY}"),)


async def ask(request: cost_pb2.ConsolidationRequest, metadata=ADMIN_AUTH):
    server = grpc.aio.server(interceptors=[ErrorMappingInterceptor()])
    servicer = CostServicer(None, None, planner(), access=CostAccess(DEFAULT_TENANTS))
    cost_pb2_grpc.add_CostServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = cost_pb2_grpc.CostServiceStub(channel)
            try:
                return await stub.WhatIfConsolidation(request, metadata=metadata, timeout=10)
            except grpc.aio.AioRpcError as error:
                return error
    finally:
        await server.stop(None)


def test_rpc_answers_the_shipped_example():
    from llmmesh.cli_cost import models_request
    response = asyncio.run(ask(models_request(str(EXAMPLE), cost_pb2.Scenario(device="cpu"), 0)))
    # Measured cpu-smollm2 at concurrency 32: 158 / 315.3 + 75 / 169.08 = 0.945 device-s per
    # request; each region peaks at 0.6 req/s (0.57 devices), both together at
    # 0.6 × (0.55 + 0.70) = 0.75 req/s (0.71 devices): 1 device each, or 1 shared.
    assert (response.dedicated.device_hours, response.shared.device_hours) == (48, 24)
    assert (response.dedicated.cost, response.shared.cost) == ("4.80", "2.40")
    assert (response.saving, response.saving_pct, response.cheaper) == ("2.40", 50.0, "shared")
    assert response.currency == "USD" and response.shared.loading_s == 0
    assert [m.concurrency for m in response.models] == [32, 32]


def test_rpc_refuses_an_unknown_curve_as_invalid_argument():
    request = cost_pb2.ConsolidationRequest(
        models=[proto_model("a"), proto_model("b", curve="nope")],
        scenario=cost_pb2.Scenario(device="a100"), device_memory_mib=2000)
    error = asyncio.run(ask(request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "models[1].curve" in error.details() and "'nope'" in error.details()
    request.models[1].curve = "flat"
    answer = asyncio.run(ask(request))
    assert answer.cheaper == "equal" and answer.shared.device_hours == 48


def test_rpc_answers_any_api_key_and_refuses_a_call_without_one():
    from llmmesh.cli_cost import models_request
    request = models_request(str(EXAMPLE), cost_pb2.Scenario(device="cpu"), 0)
    tenant = asyncio.run(ask(request, (("authorization", "Bearer llmmesh-demo-acme"),)))
    assert tenant.saving == "2.40"
    for metadata in ((), (("authorization", "Bearer not-a-key"),)):
        error = asyncio.run(ask(request, metadata))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_cli_answers_the_example_locally_and_says_where_swapping_starts():
    from typer.testing import CliRunner

    from llmmesh.cli import app
    roomy = CliRunner().invoke(app, ["whatif-consolidate", "--models", str(EXAMPLE), "--local",
                                     "--json"])
    assert roomy.exit_code == 0, roomy.output
    assert json.loads(roomy.output)["saving"] == "2.40"
    tight = CliRunner().invoke(app, ["whatif-consolidate", "--models", str(EXAMPLE), "--local",
                                     "--device-memory-mib", "1000"])
    assert tight.exit_code == 0, tight.output
    # 641 MiB each in 1000 MiB: the two take turns every hour, 24 loads of 4.68 s.
    assert "112.32" in tight.output and "take turns" in tight.output
