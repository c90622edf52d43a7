"""costd as a real subprocess for integration tests: start on a free port, wait, stop or kill."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from llmmesh import mtls
from llmmesh.apikeys import DEMO_ADMIN_KEY
from llmmesh.identity import Role
from llmmesh.launcher import free_port
from llmmesh.mtls import MeshIdentity

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden" / "costd"
START_DEADLINE_S = 20.0


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Puts `authorization: Bearer <key>` on every call of a channel."""

    def __init__(self, key: str) -> None:
        self._metadata = (("authorization", f"Bearer {key}"),)

    def _with_key(self, details):
        return details._replace(metadata=tuple(details.metadata or ()) + self._metadata)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_key(details), request)


@dataclass
class Costd:
    address: str
    db: str
    log_path: Path
    proc: subprocess.Popen

    def log(self) -> str:
        return self.log_path.read_text()

    def channel(self, role: Role = Role.ADMIN, api_key: str | None = DEMO_ADMIN_KEY) -> grpc.Channel:
        """To costd as `role`: ADMIN reads bills, ROUTER sends the spans costd bills. Every call
        carries `api_key` (the shipped tenants file's admin key unless told; None: no key)."""
        channel = mtls.channel(self.address, MeshIdentity.from_env(role), Role.COSTD)
        return grpc.intercept_channel(channel, _Bearer(api_key)) if api_key else channel


def _serving(costd: Costd) -> bool:
    with costd.channel() as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=0.2)
            request = health_pb2.HealthCheckRequest(service="")
            status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status
            return status == health_pb2.HealthCheckResponse.SERVING
        except (grpc.FutureTimeoutError, grpc.RpcError):
            return False


_SENDER_ROLES = {"router": Role.ROUTER, "llmmesh-router": Role.ROUTER,
                 "llmmesh-worker": Role.WORKER, "worker": Role.WORKER}


def export_by_sender(costd: "Costd", request) -> trace_service_pb2.ExportTraceServiceResponse:
    """Sends each resource's spans as the service that made them would (costd bills usage only
    from routers and capacity only from workers); one answer with every rejection counted."""
    rejected, messages = 0, []
    for resource_spans in request.resource_spans:
        service = next((kv.value.string_value for kv in resource_spans.resource.attributes
                        if kv.key == "service.name"), "")
        one = trace_service_pb2.ExportTraceServiceRequest(resource_spans=[resource_spans])
        with costd.channel(_SENDER_ROLES.get(service, Role.GATEWAY), api_key=None) as channel:
            answer = trace_service_pb2_grpc.TraceServiceStub(channel).Export(one, timeout=10)
        rejected += answer.partial_success.rejected_spans
        messages += [answer.partial_success.error_message] if answer.partial_success.error_message else []
    if not rejected:
        return trace_service_pb2.ExportTraceServiceResponse()
    return trace_service_pb2.ExportTraceServiceResponse(partial_success={
        "rejected_spans": rejected, "error_message": "; ".join(messages)})


def start_costd(db: str, log_path: Path, *extra: str, address: str | None = None) -> Costd:
    address = address or f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMMESH_")}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "costd", "--listen", address, "--db", db,
                                 "--tls-dir", os.environ[mtls.TLS_DIR_ENV], *extra],
                                cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    costd = Costd(address, db, log_path, proc)
    deadline = time.monotonic() + START_DEADLINE_S
    while not _serving(costd):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(costd)
            pytest.fail(f"costd did not start:\n{costd.log()}")
        time.sleep(0.05)
    return costd


def stop(costd: Costd) -> None:
    if costd.proc.poll() is None:
        costd.proc.send_signal(signal.SIGTERM)
        try:
            costd.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            costd.proc.kill()
            costd.proc.wait()


def kill(costd: Costd) -> None:
    costd.proc.send_signal(signal.SIGKILL)
    costd.proc.wait(timeout=5)
