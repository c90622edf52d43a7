"""Who may read which bill: a tenant's API key its own tenant's, the admin key the fleet's.

The mesh certificate (llmmesh.identity) says which program calls CostService; the API key says
on whose behalf. Keys come from the gateway's tenants file (llmmesh.apikeys), re-read when it
changes: a removed key stops working at the next call, a broken edit keeps the last good file.
"""
from __future__ import annotations

from dataclasses import dataclass

from llmmesh.apikeys import KeyFile, bearer_key, hash_key, load_key_file
from llmmesh.config_file import WatchedFile
from llmmesh.errors import PermissionDenied, Unauthenticated

# One message whether the tenant asked for exists or not: a refusal must not tell a tenant
# which other tenant ids are real.
NOT_YOURS = "a tenant's API key reads only its own tenant's usage, invoices and exports"
FLEET_ONLY_ADMIN = ("every tenant's bills, the fleet's reconciliation and capacity need the "
                    "admin credential, not a tenant's API key")


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated CostService caller: the admin, or one tenant."""

    tenant_id: str = ""     # "" for the admin
    is_admin: bool = False

    def __post_init__(self) -> None:
        if self.is_admin == bool(self.tenant_id):
            raise ValueError("a caller is either the admin or one tenant")


ADMIN = Caller(is_admin=True)


def authorize_read(caller: Caller, tenant_id: str) -> None:
    """PermissionDenied unless `caller` may read `tenant_id`'s bills ("" = the whole fleet)."""
    if caller.is_admin:
        return
    if not tenant_id:
        raise PermissionDenied(FLEET_ONLY_ADMIN)
    if tenant_id != caller.tenant_id:
        raise PermissionDenied(NOT_YOURS)


def caller_of(keys: KeyFile, metadata) -> Caller:
    """Unauthenticated when the call carries no key, a malformed one or one the file lacks."""
    digest = hash_key(bearer_key(metadata))
    if digest in keys.admin_digests:
        return ADMIN
    tenant_id = keys.tenant_of.get(digest)
    if tenant_id is None:
        raise Unauthenticated("API key not recognised")
    return Caller(tenant_id)


class CostAccess:
    """The tenants file, watched; a bad file at start raises (costd does not start)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file = WatchedFile(path, load_key_file, what="tenants file")

    def caller(self, metadata) -> Caller:
        return caller_of(self._file.current(), metadata)
