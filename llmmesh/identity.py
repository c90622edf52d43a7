"""Who a mesh peer is: the roles certificates name, and which role may call which method.

Every internal port requires a client certificate from the mesh CA (llmmesh.mtls); this module
reads the role out of the peer's SPIFFE URI and is the one table of what each role may call.
"""
from __future__ import annotations

import enum

import grpc

TRUST_DOMAIN = "llmmesh"
_SPIFFE_PREFIX = f"spiffe://{TRUST_DOMAIN}/"


class Role(enum.Enum):
    GATEWAY = "gateway"
    ROUTER = "router"
    WORKER = "worker"
    COSTD = "costd"
    # Operators' tools (`llmmesh bill`, `make up`'s health checks, tests' probes).
    ADMIN = "admin"


def spiffe_id(role: Role, instance: str = "local") -> str:
    return f"{_SPIFFE_PREFIX}{role.value}/{instance}"


def role_dns_name(role: Role) -> str:
    """The name a client expects in the certificate of a server of this role."""
    return f"{role.value}.{TRUST_DOMAIN}"


def role_of_spiffe_id(uri: str) -> Role | None:
    if not uri.startswith(_SPIFFE_PREFIX):
        return None
    name = uri[len(_SPIFFE_PREFIX):].split("/", 1)[0]
    try:
        return Role(name)
    except ValueError:
        return None


def peer_role(context: grpc.aio.ServicerContext) -> Role | None:
    """The caller's role from its verified certificate; None on a connection without one."""
    auth = context.auth_context() or {}
    # gRPC core lists every SAN (DNS, URI, IP) under this key once the chain verified.
    for san in auth.get("x509_subject_alternative_name", ()):
        role = role_of_spiffe_id(san.decode() if isinstance(san, bytes) else san)
        if role is not None:
            return role
    return None


# Method (full gRPC name) or service prefix → roles that may call it. Health and reflection
# answer any verified mesh peer (the handshake already demanded a mesh certificate).
ANY_PEER = frozenset(Role)
_ACCESS: dict[str, frozenset[Role]] = {
    "/grpc.health.v1.Health/": ANY_PEER,
    "/grpc.reflection.v1alpha.ServerReflection/": ANY_PEER,
    "/grpc.reflection.v1.ServerReflection/": ANY_PEER,
    # Workers run and abort requests only for routers; GetLoad also informs operators.
    "/llmmesh.v1.WorkerService/Generate": frozenset({Role.ROUTER}),
    "/llmmesh.v1.WorkerService/Abort": frozenset({Role.ROUTER}),
    "/llmmesh.v1.WorkerService/GetLoad": frozenset({Role.ROUTER, Role.ADMIN}),
    # Every service exports its spans; costd bills only the routers' and records capacity only
    # from workers (costd.receiver sorts the spans by the sender's role).
    "/opentelemetry.proto.collector.trace.v1.TraceService/Export":
        frozenset({Role.GATEWAY, Role.ROUTER, Role.WORKER}),
    "/llmmesh.v1.CostService/": frozenset({Role.ADMIN}),
}


def allowed_roles(method: str) -> frozenset[Role]:
    """Who may call `method`; nobody when the table does not name it (deny by default)."""
    if method in _ACCESS:
        return _ACCESS[method]
    service = method.rsplit("/", 1)[0] + "/"
    return _ACCESS.get(service, frozenset())
