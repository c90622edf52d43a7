"""Mutual TLS for every internal hop: credentials from a role's files, reloaded when they change,
and the interceptor that lets a verified peer call only what its role may.

A service finds its identity in `LLMMESH_TLS_DIR` (`ca.pem`, `<role>.pem`, `<role>.key`, as
`llmmesh certs` writes them, or a Kubernetes Secret mounted there). There is no plaintext mode
for internal ports: a service without its files refuses to start.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from llmmesh import certs
from llmmesh.identity import Role, allowed_roles, peer_role, role_dns_name

log = logging.getLogger("llmmesh.mtls")
TLS_DIR_ENV = "LLMMESH_TLS_DIR"
# Where `make up` keeps the mesh's CA and certificates (and operators' tools look for them).
DEFAULT_TLS_DIR = "var/tls"


class MissingIdentity(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class MeshIdentity:
    """One role's certificate, its key and the mesh CA, as files."""

    directory: Path
    role: Role

    def __post_init__(self):
        for path in (self.ca_path, self.cert_path, self.key_path):
            if not path.is_file():
                raise MissingIdentity(
                    f"no TLS identity for {self.role.value}: {path} is missing; create the mesh's "
                    f"certificates with `llmmesh certs {self.directory}` and point {TLS_DIR_ENV} there")

    @classmethod
    def from_env(cls, role: Role, directory: str | None = None) -> "MeshIdentity":
        directory = directory or os.environ.get(TLS_DIR_ENV)
        if not directory:
            raise MissingIdentity(f"{TLS_DIR_ENV} is not set: internal ports serve mutual TLS "
                                  f"only; create certificates with `llmmesh certs DIR`")
        return cls(Path(directory), role)

    @property
    def ca_path(self) -> Path:
        return self.directory / certs.CA_CERT

    @property
    def cert_path(self) -> Path:
        return certs.cert_path(self.directory, self.role)

    @property
    def key_path(self) -> Path:
        return certs.key_path(self.directory, self.role)

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(CA, key, certificate) PEM bytes."""
        return self.ca_path.read_bytes(), self.key_path.read_bytes(), self.cert_path.read_bytes()

    def stamp(self) -> tuple[int, ...]:
        return tuple(p.stat().st_mtime_ns for p in (self.ca_path, self.cert_path, self.key_path))


def server_credentials(identity: MeshIdentity) -> grpc.ServerCredentials:
    """Client certificates required and verified against the mesh CA; a rotated certificate or
    CA on disk is served from the next handshake on, without a restart."""
    def config():
        ca, key, cert = identity.read()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    seen = [identity.stamp()]

    def fetch():   # called by gRPC core before each handshake: keep it to a few stat() calls
        try:
            stamp = identity.stamp()
            if stamp == seen[0]:
                return None
            fresh = config()
        except OSError as exc:   # a rotation half-way: keep serving the last good files
            log.warning("TLS files unreadable (%s); keeping the loaded certificate", exc)
            return None
        seen[0] = stamp
        log.info("TLS certificate for %s reloaded from %s", identity.role.value, identity.directory)
        return fresh

    return grpc.dynamic_ssl_server_credentials(config(), fetch, require_client_authentication=True)


def channel_credentials(identity: MeshIdentity) -> grpc.ChannelCredentials:
    ca, key, cert = identity.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def channel_options(server_role: Role) -> list[tuple[str, str]]:
    # The server must prove the role, not the address: its certificate's DNS SAN names the role.
    return [("grpc.ssl_target_name_override", role_dns_name(server_role))]


def aio_channel(address: str, identity: MeshIdentity, server_role: Role,
                extra_options: tuple[tuple[str, int], ...] = ()) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(address, channel_credentials(identity),
                                   channel_options(server_role) + list(extra_options))


def channel(address: str, identity: MeshIdentity, server_role: Role) -> grpc.Channel:
    return grpc.secure_channel(address, channel_credentials(identity), channel_options(server_role))


def operator_channel(address: str, server_role: Role) -> grpc.Channel:
    """An operator's tool (`llmmesh bill`, `usage`) to an internal port, as the admin role, from
    LLMMESH_TLS_DIR or `make up`'s var/tls."""
    directory = os.environ.get(TLS_DIR_ENV) or DEFAULT_TLS_DIR
    return channel(address, MeshIdentity(Path(directory), Role.ADMIN), server_role)


def _deny(behavior, method: str, roles: frozenset[Role], streaming: bool):
    async def check(context) -> None:
        role = peer_role(context)
        if role not in roles:
            who = f"the {role.value} identity" if role else "a caller without a mesh identity"
            log.warning("refused %s to %s", method, who)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method} is not open to {who}")

    if streaming:
        async def stream(request, context):
            await check(context)
            async for item in behavior(request, context):
                yield item
        return stream

    async def unary(request, context):
        await check(context)
        return await behavior(request, context)
    return unary


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only when the caller's certificate names a role that may make it."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        roles = allowed_roles(method)
        kinds = (("unary_unary", False, grpc.unary_unary_rpc_method_handler),
                 ("unary_stream", True, grpc.unary_stream_rpc_method_handler),
                 ("stream_unary", False, grpc.stream_unary_rpc_method_handler),
                 ("stream_stream", True, grpc.stream_stream_rpc_method_handler))
        for attr, streaming, make in kinds:
            behavior = getattr(handler, attr)
            if behavior is not None:
                return make(_deny(behavior, method, roles, streaming),
                            handler.request_deserializer, handler.response_serializer)
        return handler
