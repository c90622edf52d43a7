"""Tenants and their API keys (stored as SHA-256 digests), loaded from a TOML file.

The file is re-read when its modification time changes, so keys and plans change without
a restart.
"""
from __future__ import annotations

import hashlib
import os
import tomllib
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from llmmesh.errors import Unauthenticated
from llmmesh.queue import CLASSES


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

    def cap_class(self, requested: str) -> str:
        """The requested class if the plan allows it, else batch (the class every plan has)."""
        return requested if requested in self.allowed_classes else "batch"


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def _parse(raw: dict) -> dict[str, Tenant]:
    by_digest: dict[str, Tenant] = {}
    for tenant_id, body in raw.get("tenants", {}).items():
        classes = tuple(body.get("allowed_classes", CLASSES))
        unknown = set(classes) - set(CLASSES)
        if unknown:
            raise ValueError(f"tenant {tenant_id}: unknown classes {sorted(unknown)}")
        plan = Plan(**{k: body[k] for k in Plan.__dataclass_fields__ if k in body})
        tenant = Tenant(tenant_id, classes, body.get("cache_scope", tenant_id), plan)
        for digest in body.get("api_key_sha256", []):
            by_digest[digest.lower()] = tenant
    return by_digest


class TenantBook:
    """Maps API keys to tenants; reloads its file when it changes."""

    def __init__(self, path: str):
        self.path = path
        self._mtime_ns = -1
        self._by_digest: dict[str, Tenant] = {}
        self._reload_if_changed()

    def _reload_if_changed(self) -> None:
        mtime_ns = os.stat(self.path).st_mtime_ns
        if mtime_ns != self._mtime_ns:
            with open(self.path, "rb") as f:
                self._by_digest = _parse(tomllib.load(f))
            self._mtime_ns = mtime_ns

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
        self._reload_if_changed()
        # Looking up the digest (not the key) leaks nothing useful through timing.
        tenant = self._by_digest.get(hash_key(key.strip()))
        if tenant is None:
            raise Unauthenticated("API key not recognised")
        return tenant
