"""Tenants file: hashed keys, plans, class caps, and reload without a restart."""
from __future__ import annotations

import os

import pytest

from gateway.tenants import Plan, TenantBook, TenantsFileError, hash_key
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


def test_a_typo_in_a_plan_key_is_refused_naming_file_line_and_key(tmp_path):
    f = tmp_path / "tenants.toml"
    f.write_text(f'# demo\n[tenants.a]\napi_key_sha256 = ["{hash_key("k1")}"]\ntoken_budjet = 100\n')
    with pytest.raises(TenantsFileError) as info:
        TenantBook(str(f))
    assert str(info.value).startswith(f"{f}:4: tenants.a.token_budjet: unknown key")
    # The key spelled right is accepted, and is a limit.
    f.write_text(f'[tenants.a]\napi_key_sha256 = ["{hash_key("k1")}"]\ntoken_budget = 100\n')
    assert TenantBook(str(f)).authenticate([("authorization", "Bearer k1")]).plan.token_budget == 100


@pytest.mark.parametrize("line, message", [
    ("max_concurrent = -1", "tenants.a.max_concurrent: must be an integer >= 0"),
    ("max_concurrent = true", "tenants.a.max_concurrent: must be an integer >= 0"),
    ('budget_period = "week"', "tenants.a.budget_period: must be one of"),
    ('allowed_classes = ["realtime"]', "tenants.a.allowed_classes: unknown classes"),
    ('cache_scope = ""', "tenants.a.cache_scope: must be a non-empty string"),
])
def test_bad_values_are_refused_with_their_key(tmp_path, line, message):
    f = tmp_path / "tenants.toml"
    f.write_text(f'[tenants.a]\napi_key_sha256 = ["{hash_key("k1")}"]\n{line}\n')
    with pytest.raises(TenantsFileError, match=message):
        TenantBook(str(f))


def test_a_bad_file_at_reload_keeps_the_last_good_one(tmp_path, caplog):
    f = tmp_path / "tenants.toml"
    _write(f, f'[tenants.a]\napi_key_sha256 = ["{hash_key("k1")}"]\nmax_concurrent = 2\n', 1_000_000_000)
    book = TenantBook(str(f))
    _write(f, '[tenants.a\napi_key_sha256 = [', 2_000_000_000)           # half-saved edit
    tenant = book.authenticate([("authorization", "Bearer k1")])
    assert tenant.plan.max_concurrent == 2                                # limit kept
    assert "not reloaded, keeping the last good one" in caplog.text and "not valid TOML" in caplog.text
    _write(f, f'[tenants.a]\napi_key_sha256 = ["{hash_key("k9")}"]\n', 3_000_000_000)
    assert book.authenticate([("authorization", "Bearer k9")]).tenant_id == "a"   # fixed: taken


def test_allowed_models_refuse_other_models_and_unset_allows_all(tmp_path):
    from llmmesh.errors import PermissionDenied
    f = tmp_path / "tenants.toml"
    f.write_text(f'[tenants.a]\napi_key_sha256 = ["{hash_key("k1")}"]\nallowed_models = ["m1"]\n'
                 f'[tenants.b]\napi_key_sha256 = ["{hash_key("k2")}"]\n')
    book = TenantBook(str(f))
    a = book.authenticate([("authorization", "Bearer k1")])
    a.check_model("m1")
    with pytest.raises(PermissionDenied, match="'m2' is not in tenant a's plan; allowed: m1"):
        a.check_model("m2")
    book.authenticate([("authorization", "Bearer k2")]).check_model("m2")   # unset: every model
    f.write_text(f'[tenants.a]\napi_key_sha256 = ["{hash_key("k1")}"]\nallowed_models = "m1"\n')
    with pytest.raises(TenantsFileError, match=r":3: tenants.a.allowed_models: must be a list"):
        TenantBook(str(f))
