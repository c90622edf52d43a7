"""PriceBook: exact decimal prices, device-type aliases, effective dates, refusals at load."""
from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from costd.pricebook import PriceBook

REPO = Path(__file__).resolve().parents[2]
H = 3_600_000_000_000
JAN_2025_NS = 1_735_689_600 * 1_000_000_000  # 2025-01-01T00:00:00Z

BOOK = """
currency = "EUR"
[aliases]
"cuda:NVIDIA-A100*" = "a100"
"cuda:*" = "gpu-other"
[devices.a100]
prices = [{ from = 2025-01-01T00:00:00Z, per_hour = 4.00, list_per_hour = 5.1 },
          { from = 2025-02-01T00:00:00Z, per_hour = 3.70 }]
[devices.gpu-other]
prices = [{ from = 2025-01-01T00:00:00Z, per_hour = 1 }]
[devices.cpu]
prices = [{ from = 2025-01-01T00:00:00+01:00, per_hour = 0.1 }]
"""


def test_shipped_price_book_has_the_seed_a100_and_every_fleet_device():
    book = PriceBook.load(REPO / "config" / "prices.toml")
    assert book.currency == "USD"
    assert book.price("a100", JAN_2025_NS).per_hour == Decimal("4.00")
    for device_type, device in [("cpu", "cpu"), ("cuda:NVIDIA-A100-SXM4-80GB", "a100"),
                                ("cuda:NVIDIA-H100-80GB-HBM3", "h100"),
                                ("cuda:NVIDIA-H200", "h200")]:
        assert book.device_for(device_type) == device
        assert book.price(device, JAN_2025_NS) is not None


def test_prices_are_exact_decimals_never_floats():
    book = PriceBook.parse(BOOK)
    price = book.price("cpu", JAN_2025_NS)
    assert price.per_hour == Decimal("0.1") and isinstance(price.per_hour, Decimal)
    assert book.price("a100", JAN_2025_NS).list_per_hour == Decimal("5.1")


def test_aliases_match_in_order_and_a_device_matches_itself():
    book = PriceBook.parse(BOOK)
    assert book.device_for("cuda:NVIDIA-A100-SXM4-40GB") == "a100"
    assert book.device_for("cuda:Tesla-T4") == "gpu-other"
    assert book.device_for("cpu") == "cpu"
    assert book.device_for("tpu") is None


def test_effective_dates_pick_the_price_in_force():
    book = PriceBook.parse(BOOK)
    feb = JAN_2025_NS + 31 * 24 * H
    assert book.price("a100", JAN_2025_NS - 1) is None  # before the first price
    assert book.price("a100", feb - 1).per_hour == Decimal("4.00")
    assert book.price("a100", feb).per_hour == Decimal("3.70")
    # list price defaults to the price when a later entry omits it
    assert book.price("a100", feb).list_per_hour == Decimal("3.70")
    # an offset is honoured: +01:00 midnight is 23:00 UTC the day before
    assert book.price("cpu", JAN_2025_NS - H) is not None


@pytest.mark.parametrize("text, message", [
    ('currency = "usd"', "ISO 4217"),
    ('[devices.x]\nprices = [{ from = 2025-01-01T00:30:00Z, per_hour = 1 }]', "whole hour"),
    ('[devices.x]\nprices = [{ from = 2025-01-01T00:00:00Z, per_hour = -1 }]', ">= 0"),
    ('[devices.x]\nprices = [{ from = 2025-01-01T00:00:00, per_hour = 1 }]', "UTC offset"),
    ('[devices.x]\nprices = []', "no prices"),
    ('[aliases]\n"cuda:*" = "nope"', "unknown device"),
    ('[devices.x]\nprices = [{ from = 2025-01-01T00:00:00Z, per_hour = "a" }]', "decimal"),
])
def test_bad_price_books_are_refused_at_load(tmp_path, text, message):
    path = tmp_path / "prices.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        PriceBook.load(path)


@pytest.mark.parametrize("text, message", [
    ('currency = "USD"\ncurency = "EUR"\n', "curency: unknown key"),
    ('[devices.cpu]\nprices = [{ from = 2024-01-01T00:00:00Z, per_hour = 1, per_huor = 2 }]\n',
     r"devices.cpu.prices\[0\].per_huor: unknown key"),
    ('[devices.cpu]\ndescripton = "x"\nprices = [{ from = 2024-01-01T00:00:00Z, per_hour = 1 }]\n',
     "devices.cpu.descripton: unknown key"),
])
def test_a_misspelt_key_is_refused_with_its_path(text, message):
    with pytest.raises(ValueError, match=message):
        PriceBook.parse(text)
