"""Shared fixtures: a real redis-server on a free port, owned by the test that asked for it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from llmmesh import certs  # noqa: E402
from llmmesh.identity import Role  # noqa: E402
from llmmesh.launcher import find_redis_server, free_port  # noqa: E402
from llmmesh.mtls import TLS_DIR_ENV, MeshIdentity, server_credentials  # noqa: E402

# One CA and one certificate per role for the whole run; every process a test starts inherits it.
# Set whatever the caller's environment says, so a test never trusts a developer's own CA.
os.environ[TLS_DIR_ENV] = tempfile.mkdtemp(prefix="llmmesh-tls-")
certs.ensure(os.environ[TLS_DIR_ENV])


def as_role(role: Role) -> MeshIdentity:
    return MeshIdentity.from_env(role)


@pytest.fixture
def identity():
    """identity(Role.X): that role's certificate in this run's mesh CA."""
    return as_role


@pytest.fixture
def serve_as():
    """serve_as(server, Role.X) adds a mutual-TLS port to an in-test gRPC server; returns it."""
    def add(server, role: Role) -> int:
        return server.add_secure_port("127.0.0.1:0", server_credentials(as_role(role)))
    return add


class RedisServer:
    """A private redis-server the test can kill and restart on the same port."""

    def __init__(self, workdir: str):
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.workdir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(str(tmp_path))
    server.start()
    yield server
    server.kill()


def pytest_report_header(config):
    return [f"redis-server: {shutil.which('redis-server')}"]
