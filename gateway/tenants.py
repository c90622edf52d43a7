"""Tenants and their API keys (stored as SHA-256 digests), loaded from a TOML file.

The file is re-read when its modification time changes, so keys and plans change without
a restart.
"""
from __future__ import annotations

import hashlib
import os
import tomllib
from dataclasses import dataclass

from llmmesh.errors import Unauthenticated
from llmmesh.queue import CLASSES


@dataclass(frozen=True, slots=True)
class Tenant:
    tenant_id: str
    allowed_classes: tuple[str, ...]
    cache_scope: str

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
        tenant = Tenant(tenant_id, classes, body.get("cache_scope", tenant_id))
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
