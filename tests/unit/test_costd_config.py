"""costd start-up config: flags beat environment beat defaults; bad values fail at start."""
from __future__ import annotations

import pytest

from costd.config import CostdConfig, parse_config


def test_defaults():
    config = parse_config([], {})
    assert (config.listen, config.ledger.path) == ("127.0.0.1:50055", "var/ledger.sqlite")


def test_environment_overrides_defaults():
    config = parse_config([], {"LLMMESH_COSTD_LISTEN": "0.0.0.0:6000",
                               "LLMMESH_LEDGER_URL": "sqlite:////srv/ledger.sqlite"})
    assert (config.listen, config.ledger.path) == ("0.0.0.0:6000", "/srv/ledger.sqlite")


def test_flags_override_environment():
    config = parse_config(["--listen", "127.0.0.1:7000", "--db", "x.sqlite"],
                          {"LLMMESH_COSTD_LISTEN": "0.0.0.0:6000", "LLMMESH_LEDGER_URL": "y"})
    assert (config.listen, config.ledger.path) == ("127.0.0.1:7000", "x.sqlite")


@pytest.mark.parametrize("listen", ["7000", ":7000", "host:", "host:99999", "host:x"])
def test_bad_listen_address_is_refused(listen):
    with pytest.raises(ValueError, match="HOST:PORT"):
        CostdConfig(listen=listen)


def test_negative_grace_is_refused():
    with pytest.raises(ValueError, match="grace_s"):
        CostdConfig(grace_s=-1)


def test_attributed_cost_counts_each_request_once():
    """costd's money metric: a repeat of a request already in the ledger adds nothing."""
    from prometheus_client import CollectorRegistry
    from costd.ledger.store import WriteResult
    from costd.metrics import CostdMetrics
    from costd.pricebook import PriceBook
    from costd.usage import LedgerBatch, UsageRecord
    book = PriceBook.load("config/prices.toml")
    device_type = next(iter(book.devices))
    registry = CollectorRegistry()
    m = CostdMetrics(registry, book)
    rec = UsageRecord(request_id="acme/r/1", tenant_id="acme", model="m", request_class="interactive",
                      num_prompt_tokens=10, num_cached_prompt_tokens=0, num_completion_tokens=5,
                      prefill_device_s=1800.0, decode_device_s=1800.0, device_type=device_type,
                      worker_id="w", finish_reasons=("stop",), end_unix_ns=2_000_000_000_000_000_000)
    price = float(book.price(device_type, rec.end_unix_ns).per_hour)
    m.committed([LedgerBatch((rec,))], WriteResult(1, 0))
    m.committed([LedgerBatch((rec,))], WriteResult(0, 0, frozenset({"acme/r/1"})))   # a repeat
    m.committed([LedgerBatch((rec, rec))], WriteResult(0, 0, frozenset({"acme/r/1"})))
    value = registry.get_sample_value("llmmesh_costd_attributed_cost_total",
                                      {"tenant": "acme", "currency": book.currency})
    assert value == pytest.approx(price)      # one hour of device time, once
    assert registry.get_sample_value("llmmesh_costd_usage_records_total", {"outcome": "duplicate"}) == 3
