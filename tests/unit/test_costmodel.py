"""Cost model: exact line costs, idle as capacity − attributed, pro-rata shares, the invariant."""
from __future__ import annotations

import random
from decimal import Decimal

import pytest

from costd.allocation import split_units
from costd.costmodel import IdlePolicy, TokenKind, build_statement
from costd.invoice import fleet_totals, invoice_for
from costd.ledger import CapacityAggregate, UsageAggregate
from costd.periods import Granularity, iso, parse_iso, period_of
from costd.pricebook import PriceBook

S = 1_000_000_000
H = 3600 * S
HOUR0 = 480_000  # 2024-10-04T00:00:00Z, in hours since the epoch
BOOK = PriceBook.parse("""
currency = "USD"
[aliases]
"cuda:NVIDIA-A100*" = "a100"
[devices.cpu]
prices = [{ from = 2024-01-01T00:00:00Z, per_hour = 3.60 }]
[devices.a100]
prices = [{ from = 2024-01-01T00:00:00Z, per_hour = 4.00, list_per_hour = 5.00 },
          { from = 2024-10-04T01:00:00Z, per_hour = 3.00, list_per_hour = 5.00 }]
""")


def usage(tenant="acme", hour=HOUR0, device="cpu", prefill_s=1.5, decode_s=6.0, prompt=100,
          cached=40, completion=50, requests=1, model="m", request_class="interactive"):
    return UsageAggregate(hour, tenant, model, request_class, device, requests, prompt, cached,
                          completion, round(prefill_s * S), round(decode_s * S))


def capacity(hour=HOUR0, device="cpu", worker="w0", seconds=3600, loading_s=0):
    return CapacityAggregate(hour, device, worker, seconds * S, loading_s * S)


def statement(usages, capacities, policy=IdlePolicy.UNUSED, granularity=Granularity.TOTAL,
              hours=2):
    return build_statement(usages, capacities, BOOK, HOUR0 * H, (HOUR0 + hours) * H,
                           granularity, policy)


def test_request_cost_is_device_time_times_price_split_by_prefill_and_decode():
    s = statement([usage()], [capacity()])
    prompt, completion, idle = s.lines
    assert (prompt.token_kind, prompt.num_tokens, prompt.num_cached_tokens) == (
        TokenKind.PROMPT, 100, 40)
    assert prompt.cost == Decimal("0.001500000")  # 1.5 s at $3.60/h = $0.001/s
    assert completion.cost == Decimal("0.006000000")
    assert prompt.cost_per_million_tokens == Decimal("15.000000")
    assert completion.cost_per_million_tokens == Decimal("120.000000")
    assert (idle.tenant_id, idle.token_kind, idle.device_ns) == ("", TokenKind.IDLE,
                                                                 3600 * S - 7_500_000_000)
    assert idle.cost == Decimal("3.592500000")


def test_cached_prompt_tokens_cost_only_the_time_they_used():
    cold = statement([usage(cached=0, prefill_s=2.0)], []).lines[0]
    warm = statement([usage(cached=90, prefill_s=0.2)], []).lines[0]
    assert cold.num_tokens == warm.num_tokens == 100
    assert warm.cost == cold.cost / 10


def test_pro_rata_shares_idle_by_device_time_and_keeps_every_unit():
    s = statement([usage("acme", prefill_s=1, decode_s=1), usage("globex", prefill_s=1,
                                                                decode_s=0)],
                  [capacity(seconds=10)], IdlePolicy.PRO_RATA)
    idle = {l.tenant_id: l for l in s.lines if l.token_kind is TokenKind.IDLE}
    assert set(idle) == {"acme", "globex"}  # no unused line left
    # 7 s idle at $0.001/s, split 2:1 → 0.004666666667 / 0.002333333333 (largest remainder)
    assert idle["acme"].cost == Decimal("0.004666667")
    assert idle["globex"].cost == Decimal("0.002333333")
    assert idle["acme"].device_ns + idle["globex"].device_ns == 7 * S
    assert sum(l.cost for l in s.lines) == Decimal("0.010000000")


def test_pro_rata_leaves_idle_unused_in_a_period_nobody_used():
    s = statement([usage(hour=HOUR0)], [capacity(HOUR0), capacity(HOUR0 + 1)],
                  IdlePolicy.PRO_RATA, Granularity.HOUR)
    unused = [l for l in s.lines if l.token_kind is TokenKind.IDLE and not l.tenant_id]
    assert [(l.period_start_ns, l.cost) for l in unused] == [((HOUR0 + 1) * H,
                                                              Decimal("3.600000000"))]


def test_loading_is_its_own_capacity_line_carved_out_of_idle():
    # 10 s of capacity at $0.001/s: 2 s of requests, 3 s loading models, 5 s idle.
    s = statement([usage(prefill_s=1, decode_s=1)], [capacity(seconds=10, loading_s=3)])
    by_kind = {l.token_kind: l for l in s.lines}
    loading, idle = by_kind[TokenKind.LOADING], by_kind[TokenKind.IDLE]
    assert (loading.tenant_id, loading.device_ns, loading.cost) == ("", 3 * S, Decimal("0.003"))
    assert (idle.device_ns, idle.cost) == (5 * S, Decimal("0.005"))
    (device,) = s.devices
    assert (device.loading_ns, device.loading_cost, device.idle_ns) == (
        3 * S, Decimal("0.003"), 5 * S)
    assert s.unused_cost == Decimal("0.008")   # idle + loading: nobody's
    assert invoice_for(s, "acme").loading_cost == 0
    # Without loading reported, the same 3 s are idle: nothing is billed twice or lost.
    plain = statement([usage(prefill_s=1, decode_s=1)], [capacity(seconds=10)])
    assert [l.token_kind for l in plain.lines].count(TokenKind.LOADING) == 0
    assert sum(l.cost for l in plain.lines) == sum(l.cost for l in s.lines) == Decimal("0.01")


def test_pro_rata_shares_loading_like_idle():
    s = statement([usage("acme", prefill_s=1, decode_s=1), usage("globex", prefill_s=1,
                                                                decode_s=0)],
                  [capacity(seconds=10, loading_s=3)], IdlePolicy.PRO_RATA)
    loading = {l.tenant_id: l for l in s.lines if l.token_kind is TokenKind.LOADING}
    assert set(loading) == {"acme", "globex"}
    assert (loading["acme"].cost, loading["globex"].cost) == (Decimal("0.002"), Decimal("0.001"))
    assert invoice_for(s, "acme").loading_cost == Decimal("0.002")
    assert s.unused_cost == 0 and sum(l.cost for l in s.lines) == Decimal("0.01")


def test_prices_follow_effective_dates_by_hour():
    s = statement([usage(hour=HOUR0, device="a100", prefill_s=3600, decode_s=0),
                   usage(hour=HOUR0 + 1, device="a100", prefill_s=3600, decode_s=0)], [])
    prompt = [l for l in s.lines if l.token_kind is TokenKind.PROMPT]
    assert [l.cost for l in prompt] == [Decimal("7.000000000")]  # $4 then $3
    assert prompt[0].list_cost == Decimal("10.000000000")


def test_unpriced_device_and_usage_beyond_capacity_are_warned_about():
    s = statement([usage(device="tpu"), usage(device="a100")], [])
    assert any("'tpu' is not in the price book" in w for w in s.warnings)
    assert any("exceeds reported capacity" in w for w in s.warnings)
    tpu = [l for l in s.lines if l.device == "tpu"]
    assert tpu and all(l.cost == 0 for l in tpu)


def test_charge_periods_cut_by_day_and_clip_to_the_range():
    start, end = HOUR0 * H + 30 * 60 * S, (HOUR0 + 48) * H
    s = build_statement([usage(hour=HOUR0), usage(hour=HOUR0 + 30)], [], BOOK, start, end,
                        Granularity.DAY)
    periods = sorted({(l.period_start_ns, l.period_end_ns) for l in s.lines})
    assert periods == [(start, (HOUR0 + 24) * H), ((HOUR0 + 24) * H, end)]


def test_month_periods_are_calendar_months():
    feb_hour = parse_iso("2024-02-10T05:00:00Z") // H
    start, end = parse_iso("2024-01-15"), parse_iso("2024-04-01")
    first, last = period_of(feb_hour, start, end, Granularity.MONTH)
    assert (iso(first), iso(last)) == ("2024-02-01T00:00:00Z", "2024-03-01T00:00:00Z")
    jan = period_of(parse_iso("2024-01-20") // H, start, end, Granularity.MONTH)
    assert iso(jan[0]) == "2024-01-15T00:00:00Z"  # clipped to the range


@pytest.mark.parametrize("policy", list(IdlePolicy))
def test_tenants_plus_idle_equal_capacity_times_price_exactly(policy):
    rng = random.Random(7)
    usages, capacities = [], []
    for hour in range(HOUR0, HOUR0 + 6):
        for worker, device in (("w0", "cpu"), ("w1", "cuda:NVIDIA-A100-SXM4-80GB")):
            seconds = rng.randint(1000, 3600)
            capacities.append(capacity(hour, device, worker, seconds,
                                       rng.choice([0, rng.randint(0, 600)])))
            for tenant in ("acme", "globex", "initech"):
                usages.append(usage(tenant, hour, device, rng.uniform(0, 90), rng.uniform(0, 200),
                                    requests=rng.randint(1, 9), request_class=rng.choice(
                                        ["interactive", "batch"])))
    s = build_statement(usages, capacities, BOOK, HOUR0 * H, (HOUR0 + 6) * H,
                        Granularity.HOUR, policy)
    for device in s.devices:
        assert device.capacity_cost == (device.attributed_cost + device.idle_allocated_cost
                                        + device.idle_unallocated_cost + device.loading_cost)
    invoices = [invoice_for(s, t) for t in s.tenant_ids]
    fleet = fleet_totals(s, invoices)
    assert fleet.capacity_cost == fleet.tenants_cost + fleet.unused_cost
    assert fleet.capacity_due == fleet.tenants_due + fleet.unused_due
    assert sum(l.cost for l in s.lines) == s.capacity_cost
    # capacity × price, computed independently of the model
    expected = sum(Decimal(c.device_ns) * (Decimal("3.60") if c.device_type == "cpu" else
                   Decimal("4.00") if c.hour == HOUR0 else Decimal("3.00")) / H
                   for c in capacities)
    assert abs(s.capacity_cost - expected) <= Decimal("0.000000001") * len(capacities)
    if policy is IdlePolicy.PRO_RATA:
        assert fleet.unused_cost == 0


def test_invoice_totals_rates_and_cents():
    s = statement([usage(prefill_s=1.5, decode_s=6.0), usage(model="m2", prefill_s=0.5,
                                                           decode_s=0.0045)], [])
    invoice = invoice_for(s, "acme")
    assert (invoice.num_requests, invoice.num_prompt_tokens, invoice.num_completion_tokens) == (
        2, 200, 100)
    assert invoice.total == Decimal("0.008004500")
    assert invoice.amount_due == Decimal("0.01")
    assert invoice.prompt_cost_per_million == Decimal("10.000000")
    assert invoice_for(s, "nobody").total == 0


def test_split_units_is_exact_and_deterministic():
    assert split_units(10, [1, 1, 1]) == [4, 3, 3]
    assert split_units(-10, [1, 1, 1]) == [-4, -3, -3]
    assert split_units(5, [0, 0]) is None
    rng = random.Random(3)
    for _ in range(100):
        weights = [rng.randint(0, 50) for _ in range(rng.randint(1, 8))]
        total = rng.randint(0, 10**6)
        shares = split_units(total, weights)
        assert shares is None or (sum(shares) == total and min(shares) >= 0)
