"""API keys: the tenants file's schema, key digests, and the bearer credential on a call.

One file holds every API credential of the mesh (stored as SHA-256 digests, never in clear):
each tenant's keys with its plan, and the operators' admin keys. The gateway maps a tenant key
to its tenant; costd maps a tenant key to that tenant's own bills and an admin key to the
fleet's. Both read the file with this one schema, so a file one refuses the other refuses too.
Operators' tools find the admin key itself (never the digest) through read_admin_key.
"""
from __future__ import annotations

import hashlib
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from llmmesh.config_file import ConfigFileError, failure
from llmmesh.errors import Unauthenticated
from llmmesh.vocab import CLASSES

PERIODS = ("none", "day", "month")
PLAN_INTS = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "token_budget")
# Every key a tenant's table may hold: anything else (a typo such as `token_budjet`) is refused,
# never read as "no limit".
TENANT_KEYS = ("api_key_sha256", "allowed_classes", "allowed_models", "cache_scope", *PLAN_INTS,
               "budget_period")
ADMIN_KEYS = ("api_key_sha256",)
_DIGEST = re.compile(r"^[0-9a-fA-F]{64}$")
# The operators' side of the admin credential: never a command-line flag (argv shows in `ps`).
ADMIN_KEY_ENV = "LLMMESH_ADMIN_KEY"
ADMIN_KEY_FILE_ENV = "LLMMESH_ADMIN_KEY_FILE"
DEFAULT_ADMIN_KEY_FILE = "var/admin.key"     # `make up` writes it, beside var/tls
DEMO_ADMIN_KEY = "llmmesh-demo-admin"        # its digest is config/tenants.toml's [admin]


class TenantsFileError(ConfigFileError):
    """A tenants file that must not be used; the message names file, line and key."""


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def bearer_key(metadata: Iterable[tuple[str, str]] | None) -> str:
    """The key of `authorization: Bearer <key>`; Unauthenticated when missing or malformed."""
    header = ""
    for key, value in metadata or ():
        if key == "authorization":
            header = value
    if not header:
        raise Unauthenticated("missing `authorization: Bearer <api key>` metadata")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthenticated("authorization metadata must be `Bearer <api key>`")
    return key.strip()


@dataclass(frozen=True, slots=True)
class KeyFile:
    """A validated tenants file."""

    tenants: Mapping[str, Mapping[str, object]]   # tenant id → its table, in file order
    tenant_of: Mapping[str, str]                  # key digest (lower case) → tenant id
    admin_digests: frozenset[str]                 # the admin credential's digests (lower case)


def _check_keys(fail, table: str, body: dict, known: tuple[str, ...]) -> None:
    for key, value in body.items():
        if key not in known:
            fail(table, key, f"unknown key; known keys: {', '.join(known)}")
        if key in PLAN_INTS and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            fail(table, key, f"must be an integer >= 0 (0 = unlimited), got {value!r}")
        if key == "budget_period" and value not in PERIODS:
            fail(table, key, f"must be one of {', '.join(PERIODS)}, got {value!r}")
        if key == "cache_scope" and (not isinstance(value, str) or not value):
            fail(table, key, "must be a non-empty string")
        if key in ("api_key_sha256", "allowed_classes", "allowed_models") and not (
                isinstance(value, list) and all(isinstance(v, str) for v in value)):
            fail(table, key, "must be a list of strings")
        if key == "api_key_sha256" and not all(_DIGEST.match(v) for v in value):
            fail(table, key, "entries must be SHA-256 hex digests (`llmmesh hash-key KEY`)")
        if key == "allowed_classes" and set(value) - set(CLASSES):
            fail(table, key, f"unknown classes {sorted(set(value) - set(CLASSES))}; "
                             f"known: {', '.join(CLASSES)}")


def _check(path: str, text: str, raw: dict) -> None:
    def fail(table: str | None, key: str | None, why: str):
        raise failure(path, text, table, key, why, TenantsFileError)

    for key, body in raw.items():
        if key not in ("tenants", "admin"):
            fail(None, key, "unknown top-level key (the file holds [tenants.<id>] tables and "
                            "[admin] only)")
        if not isinstance(body, dict):
            fail(None, key, "must be a table")
    _check_keys(fail, "admin", raw.get("admin", {}), ADMIN_KEYS)
    admin = {d.lower() for d in raw.get("admin", {}).get("api_key_sha256", [])}
    for tenant_id, body in raw.get("tenants", {}).items():
        table = f"tenants.{tenant_id}"
        if not isinstance(body, dict):
            fail(None, "tenants", f"{tenant_id} must be a table")
        _check_keys(fail, table, body, TENANT_KEYS)
        # One key, one meaning: a tenant's key that also opened the fleet's books would let
        # whoever holds it read every tenant's bill.
        if admin & {d.lower() for d in body.get("api_key_sha256", [])}:
            fail(table, "api_key_sha256", "a digest that is also in [admin]: a key is either a "
                                          "tenant's or the admin credential, never both")


def load_key_file(path: str) -> KeyFile:
    """TenantsFileError naming file, line and key when the file is wrong."""
    with open(path, "rb") as f:
        data = f.read()
    text = data.decode("utf-8", errors="replace")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TenantsFileError(f"{path}: not valid TOML: {exc}") from None
    _check(path, text, raw)
    tenants = raw.get("tenants", {})
    tenant_of = {d.lower(): tenant_id for tenant_id, body in tenants.items()
                 for d in body.get("api_key_sha256", [])}
    admin = frozenset(d.lower() for d in raw.get("admin", {}).get("api_key_sha256", []))
    return KeyFile(tenants, tenant_of, admin)


def read_admin_key(environ: Mapping[str, str] = os.environ) -> str | None:
    """LLMMESH_ADMIN_KEY, else the file LLMMESH_ADMIN_KEY_FILE (default var/admin.key), which
    must be readable by its owner alone; None when neither is there. ValueError: a bad file."""
    key = environ.get(ADMIN_KEY_ENV, "").strip()
    if key:
        return key
    path = environ.get(ADMIN_KEY_FILE_ENV) or DEFAULT_ADMIN_KEY_FILE
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if environ.get(ADMIN_KEY_FILE_ENV):
            raise ValueError(f"{ADMIN_KEY_FILE_ENV}={path}: no such file") from None
        return None
    if mode & 0o077:
        raise ValueError(f"{path} is open to other users (mode {mode & 0o777:o}): "
                         f"chmod 600 {path}")
    with open(path) as f:
        key = f.read().strip()
    if not key:
        raise ValueError(f"{path} is empty")
    return key


def write_admin_key(path: str, key: str) -> None:
    """The key in a file of mode 0600 (made so even when it was there, wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
