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
