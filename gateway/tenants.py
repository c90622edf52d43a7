"""Tenants and their API keys (stored as SHA-256 digests), loaded from a TOML file.

The file is re-read when its modification time changes, so keys and plans change without
a restart.
"""
from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from llmmesh.config_file import ConfigFileError, WatchedFile, failure
from llmmesh.errors import PermissionDenied, Unauthenticated
from llmmesh.vocab import CLASSES, RequestClass


_PERIODS = ("none", "day", "month")


@dataclass(frozen=True, slots=True)
class Plan:
    """A tenant's limits; 0 means unlimited."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_concurrent: int = 0
    token_budget: int = 0
    budget_period: str = "month"

    def __post_init__(self):
        for name in ("requests_per_minute", "tokens_per_minute", "max_concurrent", "token_budget"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.budget_period not in _PERIODS:
            raise ValueError(f"budget_period must be one of {_PERIODS}")

    def period(self, now_s: float) -> tuple[str, float]:
        """(period id, period end in unix seconds), in UTC."""
        t = datetime.fromtimestamp(now_s, timezone.utc)
        if self.budget_period == "day":
            start = t.replace(hour=0, minute=0, second=0, microsecond=0)
            return start.strftime("%Y-%m-%d"), (start + timedelta(days=1)).timestamp()
        if self.budget_period == "month":
            start = t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
            nxt = (start + timedelta(days=32)).replace(day=1)
            return start.strftime("%Y-%m"), nxt.timestamp()
        return "all", now_s + 365 * 86400


@dataclass(frozen=True, slots=True)
class Tenant:
    tenant_id: str
    allowed_classes: tuple[str, ...]
    cache_scope: str
    plan: Plan = Plan()
    # Model names this tenant may use; empty = every model the mesh serves.
    allowed_models: tuple[str, ...] = ()

    def cap_class(self, requested: str) -> str:
        """The requested class if the plan allows it, else batch (the class every plan has)."""
        return requested if requested in self.allowed_classes else RequestClass.BATCH

    def check_model(self, model: str, catalog_tenants: tuple[str, ...] = ()) -> None:
        """PermissionDenied unless the tenant may use `model` (a class is capped; a model is not:
        another model would be another answer, not a slower one): both the catalog entry's
        allowed_tenants and the tenant's own allowed_models must let it."""
        if catalog_tenants and self.tenant_id not in catalog_tenants:
            raise PermissionDenied(f"model {model!r} is not available to tenant "
                                   f"{self.tenant_id} (the catalog limits it to other tenants)")
        if self.allowed_models and model not in self.allowed_models:
            raise PermissionDenied(f"model {model!r} is not in tenant {self.tenant_id}'s plan; "
                                   f"allowed: {', '.join(self.allowed_models)}")


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


_PLAN_INTS = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "token_budget")
# Every key a tenant's table may hold: anything else (a typo such as `token_budjet`) is refused,
# never read as "no limit".
_TENANT_KEYS = ("api_key_sha256", "allowed_classes", "allowed_models", "cache_scope", *_PLAN_INTS,
                "budget_period")
_DIGEST = re.compile(r"^[0-9a-fA-F]{64}$")


class TenantsFileError(ConfigFileError):
    """A tenants file that must not be used; the message names file, line and key."""


def _check(path: str, text: str, raw: dict) -> None:
    def fail(table: str | None, key: str | None, why: str):
        raise failure(path, text, table, key, why, TenantsFileError)

    for key in raw:
        if key != "tenants":
            fail(None, key, "unknown top-level key (the file holds [tenants.<id>] tables only)")
    for tenant_id, body in raw.get("tenants", {}).items():
        table = f"tenants.{tenant_id}"
        if not isinstance(body, dict):
            fail(None, "tenants", f"{tenant_id} must be a table")
        for key, value in body.items():
            if key not in _TENANT_KEYS:
                fail(table, key, f"unknown key; known keys: {', '.join(_TENANT_KEYS)}")
            if key in _PLAN_INTS and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                fail(table, key, f"must be an integer >= 0 (0 = unlimited), got {value!r}")
            if key == "budget_period" and value not in _PERIODS:
                fail(table, key, f"must be one of {', '.join(_PERIODS)}, got {value!r}")
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


def _parse(raw: dict) -> dict[str, Tenant]:
    by_digest: dict[str, Tenant] = {}
    for tenant_id, body in raw.get("tenants", {}).items():
        classes = tuple(body.get("allowed_classes", CLASSES))
        plan = Plan(**{k: body[k] for k in Plan.__dataclass_fields__ if k in body})
        tenant = Tenant(tenant_id, classes, body.get("cache_scope", tenant_id), plan,
                        tuple(body.get("allowed_models", ())))
        for digest in body.get("api_key_sha256", []):
            by_digest[digest.lower()] = tenant
    return by_digest


def load_tenants(path: str) -> dict[str, Tenant]:
    """API-key digest → tenant; TenantsFileError naming file, line and key when it is wrong."""
    with open(path, "rb") as f:
        data = f.read()
    text = data.decode("utf-8", errors="replace")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TenantsFileError(f"{path}: not valid TOML: {exc}") from None
    _check(path, text, raw)
    return _parse(raw)


class TenantBook:
    """Maps API keys to tenants; reloads its file when it changes."""

    def __init__(self, path: str):
        self.path = path
        self._file = WatchedFile(path, load_tenants, what="tenants file")  # a bad file stops start-up

    @property
    def _by_digest(self) -> dict[str, Tenant]:
        return self._file.current()

    def tenants(self) -> list[Tenant]:
        """Every tenant of the file as last loaded, once each."""
        return list({t.tenant_id: t for t in list(self._by_digest.values())}.values())

    def authenticate(self, metadata) -> Tenant:
        header = ""
        for key, value in metadata or ():
            if key == "authorization":
                header = value
        if not header:
            raise Unauthenticated("missing `authorization: Bearer <api key>` metadata")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("authorization metadata must be `Bearer <api key>`")
        # Looking up the digest (not the key) leaks nothing useful through timing.
        tenant = self._by_digest.get(hash_key(key.strip()))
        if tenant is None:
            raise Unauthenticated("API key not recognised")
        return tenant
