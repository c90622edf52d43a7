"""Tenants file: hashed keys, plans, class caps, and reload without a restart."""
from __future__ import annotations

import os

import pytest

from gateway.tenants import Plan, TenantBook, hash_key
from llmmesh.errors import Unauthenticated


def _write(path, body: str, mtime_ns: int) -> None:
    path.write_text(body)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_keys_plans_and_reload(tmp_path):
    f = tmp_path / "tenants.toml"
    _write(f, f'[tenants.a]\napi_key_sha256 = ["{hash_key("k1")}"]\nallowed_classes = ["batch"]\n'
              'requests_per_minute = 5\n', 1_000_000_000)
    book = TenantBook(str(f))
    tenant = book.authenticate([("authorization", "Bearer k1")])
    assert tenant.tenant_id == "a" and tenant.plan.requests_per_minute == 5
    assert tenant.cap_class("interactive") == "batch"  # the plan caps the class
    with pytest.raises(Unauthenticated):
        book.authenticate([("authorization", "Bearer k2")])
    # Rotate the key in the file: the old one stops working, the new one works, no restart.
    _write(f, f'[tenants.a]\napi_key_sha256 = ["{hash_key("k2")}"]\n', 2_000_000_000)
    assert book.authenticate([("authorization", "Bearer k2")]).plan == Plan()
    with pytest.raises(Unauthenticated):
        book.authenticate([("authorization", "Bearer k1")])


@pytest.mark.parametrize("metadata", [[], [("authorization", "k1")], [("authorization", "Bearer ")],
                                      [("authorization", "Basic k1")]])
def test_malformed_authorization_is_unauthenticated(tmp_path, metadata):
    f = tmp_path / "tenants.toml"
    f.write_text(f'[tenants.a]\napi_key_sha256 = ["{hash_key("k1")}"]\n')
    with pytest.raises(Unauthenticated):
        TenantBook(str(f)).authenticate(metadata)


def test_plan_periods_and_validation():
    assert Plan(budget_period="day").period(86400 * 3 + 5) == ("1970-01-04", 86400 * 4)
    assert Plan(budget_period="month").period(86400 * 40)[0] == "1970-02"
    with pytest.raises(ValueError):
        Plan(requests_per_minute=-1)
    with pytest.raises(ValueError):
        Plan(budget_period="week")
