"""One mesh (redis, costd, a worker on the real model, router, gateway) shared by the e2e modules
that don't break it; tests that kill parts build their own."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from llmmesh.launcher import Mesh
from llmmesh.v1 import gateway_pb2_grpc
from tests.e2e.span_capture import SpanCapture


@pytest.fixture(scope="session")
def span_capture():
    capture = SpanCapture()
    yield capture
    capture.stop()


@pytest.fixture(scope="session")
def mesh(tmp_path_factory, span_capture):
    m = Mesh(var_dir=str(tmp_path_factory.mktemp("mesh")), worker_args=["--max-num-seqs", "8"],
             extra_otlp_endpoints=[span_capture.address])
    try:
        asyncio.run(m.up(num_workers=1, timeout_s=240))
        yield m
    finally:
        m.down()


@pytest.fixture(scope="session")
def gateway(mesh):
    with grpc.insecure_channel(mesh.procs["gateway"].address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)
