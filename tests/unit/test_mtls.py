"""Mesh identities without a mesh: certificates name their role, files are private, a server
picks up rotated files at the next handshake, a missing identity says what to run, and the
access table denies what it does not name."""
from __future__ import annotations

import asyncio
import shutil
import stat

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmmesh import certs, mtls
from llmmesh.identity import Role, allowed_roles, role_of_spiffe_id, spiffe_id
from llmmesh.mtls import MeshIdentity, MissingIdentity


def test_a_certificate_names_its_role_and_its_files_are_private(tmp_path):
    certs.ensure(tmp_path, roles=[Role.ROUTER])
    cert = x509.load_pem_x509_certificate(certs.cert_path(tmp_path, Role.ROUTER).read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [spiffe_id(Role.ROUTER)]
    assert "router.llmmesh" in sans.get_values_for_type(x509.DNSName)
    for path in tmp_path.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert not certs.cert_path(tmp_path, Role.WORKER).exists()   # only the roles asked for


def test_roles_come_only_from_our_trust_domain():
    assert role_of_spiffe_id("spiffe://llmmesh/router/r1") is Role.ROUTER
    assert role_of_spiffe_id("spiffe://other/router/r1") is None
    assert role_of_spiffe_id("spiffe://llmmesh/root/x") is None


def test_the_access_table_denies_what_it_does_not_name():
    assert allowed_roles("/llmmesh.v1.WorkerService/Generate") == {Role.ROUTER}
    assert allowed_roles("/llmmesh.v1.CostService/GetUsage") == {Role.ADMIN}
    assert allowed_roles("/llmmesh.v1.WorkerService/NewMethod") == frozenset()
    assert allowed_roles("/llmmesh.v1.NoSuchService/X") == frozenset()


def test_a_missing_identity_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.delenv(mtls.TLS_DIR_ENV)
    with pytest.raises(MissingIdentity, match="llmmesh certs"):
        MeshIdentity.from_env(Role.WORKER)
    with pytest.raises(MissingIdentity, match="ca.pem is missing"):
        MeshIdentity.from_env(Role.WORKER, str(tmp_path))


def _check(address: str, identity: MeshIdentity) -> str:
    with mtls.channel(address, identity, Role.WORKER) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
            return "ok"
        except grpc.RpcError as exc:
            return exc.code().name


def test_a_server_serves_rotated_files_from_the_next_handshake(tmp_path):
    live, old, new = tmp_path / "live", tmp_path / "old", tmp_path / "new"
    certs.ensure(live)
    shutil.copytree(live, old)
    certs.ensure(new)          # another CA altogether: the hardest rotation

    async def body():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", mtls.server_credentials(MeshIdentity(live, Role.WORKER)))
        await server.start()
        address = f"127.0.0.1:{port}"
        try:
            before = await asyncio.to_thread(_check, address, MeshIdentity(old, Role.ROUTER))
            refused_before = await asyncio.to_thread(_check, address, MeshIdentity(new, Role.ROUTER))
            for path in new.iterdir():     # what `kubectl` does to a mounted Secret, file by file
                shutil.copy(path, live / path.name)
            after_new = await asyncio.to_thread(_check, address, MeshIdentity(new, Role.ROUTER))
            after_old = await asyncio.to_thread(_check, address, MeshIdentity(old, Role.ROUTER))
            return before, refused_before, after_new, after_old
        finally:
            await server.stop(0)

    assert asyncio.run(body()) == ("ok", "UNAVAILABLE", "ok", "UNAVAILABLE")
