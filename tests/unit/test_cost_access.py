"""Who may read which bill (costd.access) and the shared key file (llmmesh.apikeys)."""
from __future__ import annotations

import os

import pytest

from costd.access import ADMIN, NOT_YOURS, Caller, CostAccess, authorize_read, caller_of
from gateway.tenants import TenantBook
from llmmesh.apikeys import (ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, TenantsFileError, hash_key,
                             load_key_file, read_admin_key, write_admin_key)
from llmmesh.errors import PermissionDenied, Unauthenticated

ACME, GLOBEX = Caller("acme"), Caller("globex")


def _file(tmp_path, *, admin=("root-key",), acme=("acme-key",), globex=("globex-key",)) -> str:
    def digests(keys):
        return ", ".join(f'"{hash_key(k)}"' for k in keys)
    path = tmp_path / "tenants.toml"
    path.write_text(f"[admin]\napi_key_sha256 = [{digests(admin)}]\n"
                    f"[tenants.acme]\napi_key_sha256 = [{digests(acme)}]\n"
                    f"[tenants.globex]\napi_key_sha256 = [{digests(globex)}]\n")
    return str(path)


def _auth(key: str):
    return (("authorization", f"Bearer {key}"),)


def _bump_mtime(path: str, step_ns: int) -> None:
    # A rewrite inside one mtime tick would look unchanged; the test must not depend on it.
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + step_ns))


def test_a_tenant_reads_its_own_bills_and_the_admin_every_bill():
    authorize_read(ACME, "acme")
    for tenant_id in ("acme", "globex", "nobody", ""):
        authorize_read(ADMIN, tenant_id)


def test_a_tenant_reading_another_tenant_is_denied_alike_whether_it_exists_or_not():
    messages = []
    for tenant_id in ("globex", "nobody"):
        with pytest.raises(PermissionDenied) as denied:
            authorize_read(ACME, tenant_id)
        messages.append(denied.value.message)
        assert tenant_id not in denied.value.message
    assert messages == [NOT_YOURS, NOT_YOURS]


def test_a_tenant_key_never_reads_the_fleet():
    with pytest.raises(PermissionDenied, match="need the admin credential"):
        authorize_read(ACME, "")


def test_a_caller_is_the_admin_or_one_tenant_never_both():
    with pytest.raises(ValueError):
        Caller("acme", is_admin=True)
    with pytest.raises(ValueError):
        Caller()


def test_keys_map_to_their_caller(tmp_path):
    keys = load_key_file(_file(tmp_path))
    assert caller_of(keys, _auth("root-key")) == ADMIN
    assert caller_of(keys, _auth("acme-key")) == ACME
    assert caller_of(keys, [("x-other", "1"), ("authorization", "bearer globex-key ")]) == GLOBEX


@pytest.mark.parametrize("metadata", [
    (), None, _auth("not-a-key"), (("authorization", "Basic root-key"),),
    (("authorization", "Bearer "),), (("authorization", "root-key"),),
    # The digest itself is not the key.
    _auth(hash_key("root-key")),
])
def test_missing_malformed_or_unknown_keys_are_unauthenticated(tmp_path, metadata):
    keys = load_key_file(_file(tmp_path))
    with pytest.raises(Unauthenticated):
        caller_of(keys, metadata)


def test_a_revoked_key_stops_at_the_next_call_and_a_bad_edit_keeps_the_last_good_file(tmp_path, caplog):
    path = _file(tmp_path, acme=("acme-key", "acme-old"))
    access = CostAccess(path)
    assert access.caller(_auth("acme-old")) == ACME
    _file(tmp_path, acme=("acme-key",))
    _bump_mtime(path, 1_000_000_000)
    with pytest.raises(Unauthenticated):
        access.caller(_auth("acme-old"))
    assert access.caller(_auth("acme-key")) == ACME
    (tmp_path / "tenants.toml").write_text("[admin\napi_key_sha256 = [")   # half-saved edit
    _bump_mtime(path, 2_000_000_000)
    assert access.caller(_auth("root-key")) == ADMIN                      # not locked out
    assert "not reloaded, keeping the last good one" in caplog.text
    with pytest.raises(Unauthenticated):
        access.caller(_auth("acme-old"))                                  # nor let back in


def test_a_bad_file_at_start_is_refused_naming_line_and_key(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(f'[admin]\napi_key_sha256 = ["{hash_key("k")}"]\nrole = "root"\n')
    with pytest.raises(TenantsFileError, match=r":3: admin.role: unknown key"):
        CostAccess(str(path))
    path.write_text('[admin]\napi_key_sha256 = ["k"]\n')
    with pytest.raises(TenantsFileError, match=r":2: admin.api_key_sha256: entries must be SHA-256"):
        CostAccess(str(path))


def test_a_key_is_a_tenants_or_the_admins_never_both(tmp_path):
    shared = hash_key("shared")
    path = tmp_path / "tenants.toml"
    path.write_text(f'[admin]\napi_key_sha256 = ["{shared}"]\n'
                    f'[tenants.acme]\napi_key_sha256 = ["{shared.upper()}"]\n')
    with pytest.raises(TenantsFileError, match=r":4: tenants.acme.api_key_sha256: .*also in \[admin\]"):
        load_key_file(str(path))


def test_the_gateway_accepts_tenant_keys_from_the_same_file_but_never_the_admin_key(tmp_path):
    book = TenantBook(_file(tmp_path))
    assert book.authenticate(_auth("acme-key")).tenant_id == "acme"
    with pytest.raises(Unauthenticated):
        book.authenticate(_auth("root-key"))
    assert sorted(t.tenant_id for t in book.tenants()) == ["acme", "globex"]


def test_the_shipped_demo_file_has_an_admin_key_apart_from_the_tenants():
    from costd.config import DEFAULT_TENANTS
    from llmmesh.apikeys import DEMO_ADMIN_KEY
    keys = load_key_file(DEFAULT_TENANTS)
    assert caller_of(keys, _auth(DEMO_ADMIN_KEY)) == ADMIN
    assert caller_of(keys, _auth("llmmesh-demo-acme")) == ACME


def test_the_admin_key_comes_from_the_environment_or_an_owner_only_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert read_admin_key({}) is None                                # no var/admin.key here
    key_file = tmp_path / "admin.key"
    write_admin_key(str(key_file), "from-file")
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert read_admin_key({ADMIN_KEY_FILE_ENV: str(key_file)}) == "from-file"
    assert read_admin_key({ADMIN_KEY_ENV: "from-env", ADMIN_KEY_FILE_ENV: str(key_file)}) == "from-env"
    key_file.chmod(0o644)
    with pytest.raises(ValueError, match="open to other users"):
        read_admin_key({ADMIN_KEY_FILE_ENV: str(key_file)})
    write_admin_key(str(key_file), "again")                         # rewriting narrows the mode
    assert key_file.stat().st_mode & 0o777 == 0o600
    with pytest.raises(ValueError, match="no such file"):
        read_admin_key({ADMIN_KEY_FILE_ENV: str(tmp_path / "missing.key")})
