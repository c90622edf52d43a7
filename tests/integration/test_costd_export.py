"""`llmmesh bill --out FILE` is crash-safe: kill -9 mid-export leaves the old file; a finished
export leaves the complete new one; a broken or corrupted stream never replaces the old file.

costd is stood in for by a CostService that streams the first chunk and then waits for the
test, so the kill lands mid-export every time, not by luck of timing.
"""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest

from costd_proc import REPO
from llmmesh.apikeys import ADMIN_KEY_ENV, DEMO_ADMIN_KEY
from llmmesh.identity import Role
from llmmesh.v1 import cost_pb2, cost_pb2_grpc

pytestmark = pytest.mark.timeout(60)
NEW = [b"BilledCost,x_TenantId\r\n", b"0.100000000,acme\r\n" * 1000]


class StallingCostService(cost_pb2_grpc.CostServiceServicer):
    def __init__(self) -> None:
        self.first_chunk_sent = threading.Event()
        self.release = threading.Event()
        self.mode = "complete"

    def ExportBilling(self, request, context):
        yield cost_pb2.ExportBillingChunk(data=NEW[0])
        self.first_chunk_sent.set()
        self.release.wait(30)
        if self.mode == "broken":
            context.abort(grpc.StatusCode.UNAVAILABLE, "costd went away")
        yield cost_pb2.ExportBillingChunk(data=NEW[1])
        data = b"".join(NEW) if self.mode == "complete" else b"tampered"
        yield cost_pb2.ExportBillingChunk(summary=cost_pb2.ExportSummary(
            rows=1000, size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))


@pytest.fixture
def fake_costd(serve_as):
    service = StallingCostService()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    cost_pb2_grpc.add_CostServiceServicer_to_server(service, server)
    port = serve_as(server, Role.COSTD)   # the CLI calls costd over mutual TLS only
    server.start()
    service.address = f"127.0.0.1:{port}"
    yield service
    service.release.set()
    server.stop(None)


def bill(address: str, out) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llmmesh.cli", "bill", "--costd", address,
                             "--format", "focus", "--out", str(out)], cwd=REPO,
                            env={**os.environ, ADMIN_KEY_ENV: DEMO_ADMIN_KEY},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def temp_files(directory) -> list:
    return sorted(p for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_kill_9_mid_export_keeps_the_old_file_then_a_full_run_replaces_it(fake_costd, tmp_path):
    out = tmp_path / "focus.csv"
    out.write_bytes(b"the old export\n")
    cli = bill(fake_costd.address, out)
    try:
        assert fake_costd.first_chunk_sent.wait(30)
        deadline = time.monotonic() + 10
        while not any(p.stat().st_size for p in temp_files(tmp_path)):  # half written
            assert time.monotonic() < deadline, "the CLI never started writing"
            time.sleep(0.01)
        cli.send_signal(signal.SIGKILL)
        cli.wait(10)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert out.read_bytes() == b"the old export\n"
    fake_costd.first_chunk_sent.clear()
    fake_costd.release.set()
    done = bill(fake_costd.address, out)
    assert done.wait(30) == 0, done.stderr.read()
    assert out.read_bytes() == b"".join(NEW)


@pytest.mark.parametrize("mode, message", [("broken", "UNAVAILABLE"),
                                           ("tampered", "SHA-256 does not match")])
def test_a_broken_or_corrupt_stream_never_replaces_the_file(fake_costd, tmp_path, mode, message):
    out = tmp_path / "focus.csv"
    out.write_bytes(b"the old export\n")
    fake_costd.mode = mode
    fake_costd.release.set()
    cli = bill(fake_costd.address, out)
    assert cli.wait(30) != 0
    assert message in cli.stderr.read().decode()
    assert out.read_bytes() == b"the old export\n"
    assert temp_files(tmp_path) == []  # an orderly failure cleans up after itself
