"""Tenants and their plans, from the tenants file (its schema and key digests: llmmesh.apikeys).

The file is re-read when its modification time changes, so keys and plans change without
a restart.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from llmmesh.apikeys import PERIODS as _PERIODS
from llmmesh.apikeys import KeyFile, TenantsFileError, bearer_key, hash_key, load_key_file
from llmmesh.config_file import WatchedFile
from llmmesh.errors import PermissionDenied, Unauthenticated
from llmmesh.vocab import CLASSES, RequestClass

# Re-exported: the gateway's callers and tests name them here.
__all__ = ["Plan", "Tenant", "TenantBook", "TenantsFileError", "hash_key", "load_tenants"]


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


def _parse(keys: KeyFile) -> dict[str, Tenant]:
    by_digest: dict[str, Tenant] = {}
    for tenant_id, body in keys.tenants.items():
        classes = tuple(body.get("allowed_classes", CLASSES))
        plan = Plan(**{k: body[k] for k in Plan.__dataclass_fields__ if k in body})
        tenant = Tenant(tenant_id, classes, body.get("cache_scope", tenant_id), plan,
                        tuple(body.get("allowed_models", ())))
        for digest in body.get("api_key_sha256", []):
            by_digest[digest.lower()] = tenant
    return by_digest


def load_tenants(path: str) -> dict[str, Tenant]:
    """API-key digest → tenant (the file's [admin] keys are costd's, never a tenant's);
    TenantsFileError naming file, line and key when it is wrong."""
    return _parse(load_key_file(path))


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
        # Looking up the digest (not the key) leaks nothing useful through timing.
        tenant = self._by_digest.get(hash_key(bearer_key(metadata)))
        if tenant is None:
            raise Unauthenticated("API key not recognised")
        return tenant
