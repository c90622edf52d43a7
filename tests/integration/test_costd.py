"""costd as a real process: real OTel SDK spans in, CostService usage out, clean SIGTERM."""
from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, SimpleSpanProcessor,
                                            SpanExporter, SpanExportResult)

from llmmesh import mtls
from llmmesh.apikeys import DEMO_ADMIN_KEY
from llmmesh.identity import Role
from llmmesh.launcher import free_port
from llmmesh.mtls import MeshIdentity
from llmmesh.v1 import cost_pb2, cost_pb2_grpc

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
S = 1_000_000_000
BASE_S = 1_700_000_000
START_DEADLINE_S = 20.0
# costd reads the shipped config/tenants.toml: its [admin] key reads every tenant's usage.
ADMIN_AUTH = (("authorization", f"Bearer {DEMO_ADMIN_KEY}"),)


@dataclass
class Costd:
    address: str
    db_path: Path
    log_path: Path
    proc: subprocess.Popen

    def log(self) -> str:
        return self.log_path.read_text()

    def channel(self, role: Role = Role.ADMIN) -> grpc.Channel:
        """To costd as `role`: ADMIN reads bills, ROUTER sends the spans costd bills."""
        return mtls.channel(self.address, MeshIdentity.from_env(role), Role.COSTD)


def health_status(channel: grpc.Channel, service: str) -> int:
    request = health_pb2.HealthCheckRequest(service=service)
    return health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status


def wait_until_serving(costd: Costd) -> None:
    deadline = time.monotonic() + START_DEADLINE_S
    with costd.channel() as channel:
        while time.monotonic() < deadline:
            assert costd.proc.poll() is None, f"costd exited early:\n{costd.log()}"
            try:
                grpc.channel_ready_future(channel).result(timeout=0.2)
                if health_status(channel, "") == health_pb2.HealthCheckResponse.SERVING:
                    return
            except (grpc.FutureTimeoutError, grpc.RpcError):
                continue
    pytest.fail(f"costd not serving after {START_DEADLINE_S} s:\n{costd.log()}")


def start_costd(db_path: Path, log_path: Path) -> Costd:
    address = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMMESH_")}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "costd", "--listen", address, "--db", str(db_path),
             "--tls-dir", os.environ[mtls.TLS_DIR_ENV]],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    costd = Costd(address, db_path, log_path, proc)
    try:
        wait_until_serving(costd)
    except BaseException:
        stop(costd)
        raise
    return costd


def stop(costd: Costd) -> None:
    if costd.proc.poll() is None:
        costd.proc.send_signal(signal.SIGTERM)
        try:
            costd.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            costd.proc.kill()
            costd.proc.wait()


@pytest.fixture(scope="module")
def costd(tmp_path_factory):
    """One daemon for the tests that only send and query; each uses its own tenants."""
    tmp_path = tmp_path_factory.mktemp("costd")
    server = start_costd(tmp_path / "var" / "ledger.sqlite", tmp_path / "costd.log")
    yield server
    stop(server)


@pytest.fixture
def own_costd(tmp_path):
    """A daemon of the test's own, for tests that stop or kill it."""
    server = start_costd(tmp_path / "var" / "ledger.sqlite", tmp_path / "costd.log")
    yield server
    stop(server)


class RecordingExporter(SpanExporter):
    """The real OTLP exporter, keeping each export's result so a failed send fails the test."""

    def __init__(self, address: str) -> None:
        # As the router: costd bills usage spans only from router identities.
        router = MeshIdentity.from_env(Role.ROUTER)
        self.inner = OTLPSpanExporter(endpoint=address, credentials=mtls.channel_credentials(router),
                                      channel_options=tuple(mtls.channel_options(Role.COSTD)),
                                      timeout=10)
        self.results: list[SpanExportResult] = []

    def export(self, spans):
        result = self.inner.export(spans)
        self.results.append(result)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.inner.force_flush(timeout_millis)


@dataclass(frozen=True)
class Request:
    request_id: str
    tenant_id: str
    end_s: int
    prompt: int
    cached: int
    completion: int
    prefill_s: float
    decode_s: float


def make_requests(seed: int, tenants: tuple[str, ...], per_tenant: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for tenant in tenants:
        for i in range(per_tenant):
            prompt = rng.randint(1, 4000)
            requests.append(Request(
                f"{tenant}-{seed}-{i}", tenant, BASE_S + i, prompt, rng.randint(0, prompt),
                rng.randint(0, 512), rng.uniform(0, 2), rng.uniform(0, 5)))
    return requests


def usage_attributes(r: Request) -> dict:
    return {
        "llmmesh.request.id": r.request_id, "llmmesh.tenant.id": r.tenant_id,
        "gen_ai.request.model": "smollm2-135m-instruct", "llmmesh.request.class": "batch",
        "gen_ai.usage.input_tokens": r.prompt, "gen_ai.usage.output_tokens": r.completion,
        "gen_ai.usage.cache_read.input_tokens": r.cached,
        "llmmesh.prefill.device_seconds": r.prefill_s,
        "llmmesh.decode.device_seconds": r.decode_s, "llmmesh.device.type": "cpu",
        "llmmesh.worker.id": "w0", "gen_ai.response.finish_reasons": ["stop"],
    }


def emit(address: str, requests: list[Request], batch: bool = True) -> RecordingExporter:
    """Each request as the mesh sends it: a worker attempt span plus the router's final span."""
    exporter = RecordingExporter(address)
    provider = TracerProvider(resource=Resource.create({"service.name": "router"}))
    processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("tests.integration")
    for r in requests:
        start_ns, end_ns = (r.end_s - 1) * S, r.end_s * S
        # A first attempt that died half-way: it carries the request id and partial usage but
        # no final flag, and ends first, so billing from it would under-bill the request.
        partial = {**usage_attributes(r), "gen_ai.usage.output_tokens": r.completion // 2}
        attempt = tracer.start_span("gen_ai.generate", start_time=start_ns, attributes=partial)
        attempt.end(end_time=end_ns - 1)
        final = tracer.start_span("llmmesh.request", start_time=start_ns, attributes={
            **usage_attributes(r), "llmmesh.usage.final": True})
        final.end(end_time=end_ns)
    assert provider.force_flush(30_000)
    provider.shutdown()
    assert exporter.results and set(exporter.results) == {SpanExportResult.SUCCESS}
    return exporter


def get_usage(channel: grpc.Channel, tenant: str, start_s: float = 0,
              end_s: float = 0) -> cost_pb2.GetUsageResponse:
    request = cost_pb2.GetUsageRequest(tenant_id=tenant, start_unix_s=start_s, end_unix_s=end_s)
    return cost_pb2_grpc.CostServiceStub(channel).GetUsage(request, metadata=ADMIN_AUTH, timeout=5)


def assert_usage_matches(response: cost_pb2.GetUsageResponse, requests: list[Request]) -> None:
    assert response.requests == len(requests)
    assert response.prompt_tokens == sum(r.prompt for r in requests)
    assert response.cached_prompt_tokens == sum(r.cached for r in requests)
    assert response.completion_tokens == sum(r.completion for r in requests)
    assert response.prefill_device_seconds == pytest.approx(sum(r.prefill_s for r in requests))
    assert response.decode_device_seconds == pytest.approx(sum(r.decode_s for r in requests))


def test_usage_per_tenant_equals_ground_truth_despite_retried_exports(costd):
    requests = make_requests(seed=1, tenants=("acme", "globex"), per_tenant=20)
    emit(costd.address, requests)
    # A sender that retries (or a router that restarted) exports the same requests again.
    emit(costd.address, requests[:5] + requests[25:30], batch=False)
    with costd.channel() as channel:
        for tenant in ("acme", "globex"):
            truth = [r for r in requests if r.tenant_id == tenant]
            assert_usage_matches(get_usage(channel, tenant), truth)
        window = [r for r in requests if r.tenant_id == "acme" and BASE_S + 5 <= r.end_s < BASE_S + 10]
        assert len(window) == 5
        assert_usage_matches(get_usage(channel, "acme", BASE_S + 5, BASE_S + 10), window)
        assert get_usage(channel, "umbrella") == cost_pb2.GetUsageResponse(tenant_id="umbrella")


def kv(key: str, value) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=value))


def final_span(span_id: int, **attributes) -> trace_pb2.Span:
    values = {"llmmesh.usage.final": True, "llmmesh.request.id": f"req-{span_id}",
              "llmmesh.tenant.id": "initech", "gen_ai.usage.input_tokens": 10,
              "gen_ai.usage.output_tokens": 3, **attributes}
    return trace_pb2.Span(
        trace_id=b"\x07" * 16, span_id=span_id.to_bytes(8, "big"), name="llmmesh.request",
        start_time_unix_nano=BASE_S * S, end_time_unix_nano=BASE_S * S + 1,
        attributes=[kv(k, v) for k, v in values.items() if v is not None])


def export(costd: Costd, spans: list[trace_pb2.Span]):
    """Sent as a router would (the only identity whose usage spans costd bills)."""
    request = trace_service_pb2.ExportTraceServiceRequest(resource_spans=[{
        "scope_spans": [{"spans": spans}]}])
    with costd.channel(Role.ROUTER) as channel:
        return trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=5)


def test_malformed_spans_are_reported_and_the_rest_of_the_batch_lands(costd):
    spans = [final_span(1),
             final_span(2, **{"llmmesh.tenant.id": None}),
             final_span(3, **{"gen_ai.usage.output_tokens": -4}),
             final_span(4, **{"llmmesh.usage.final": None})]  # not usage: ignored, not rejected
    with costd.channel() as channel:
        response = export(costd, spans)
        assert response.partial_success.rejected_spans == 2
        message = response.partial_success.error_message
        assert "(request req-2): llmmesh.tenant.id is required" in message
        assert "(request req-3): gen_ai.usage.output_tokens must be >= 0, got -4" in message
        assert get_usage(channel, "initech").requests == 1
        assert not export(costd, [final_span(5)]).HasField("partial_success")
        assert get_usage(channel, "initech").requests == 2
    assert costd.proc.poll() is None


@pytest.mark.parametrize("tenant, start_s, end_s, detail", [
    ("", 0, 0, "tenant_id: is required"),
    ("acme", 20, 10, "end_unix_s: 10.0 is before start_unix_s 20.0"),
    ("acme", -1, 0, "start_unix_s: must be a finite number >= 0, got -1.0"),
])
def test_bad_usage_queries_are_invalid_argument(costd, tenant, start_s, end_s, detail):
    with costd.channel() as channel, pytest.raises(grpc.RpcError) as caught:
        get_usage(channel, tenant, start_s, end_s)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == detail


def test_health_is_serving_for_the_server_and_cost_service(costd):
    with costd.channel() as channel:
        for service in ("", "llmmesh.v1.CostService",
                        "opentelemetry.proto.collector.trace.v1.TraceService"):
            assert health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as caught:
            health_status(channel, "llmmesh.v1.NoSuchService")
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def ledger_rows(db_path: Path) -> int:
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        return conn.execute("SELECT COUNT(*) FROM usage_records").fetchone()[0]
    finally:
        conn.close()


def test_sigterm_exits_zero_and_the_ledger_dedupes_across_restarts(tmp_path):
    db_path, log_path = tmp_path / "ledger.sqlite", tmp_path / "costd.log"
    requests = make_requests(seed=2, tenants=("acme",), per_tenant=10)
    first = start_costd(db_path, log_path)
    try:
        emit(first.address, requests)
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=5) == 0, first.log()
    finally:
        stop(first)
    assert "costd stopped" in first.log()
    assert ledger_rows(db_path) == 10
    second = start_costd(db_path, log_path)
    try:
        emit(second.address, requests)
        with second.channel() as channel:
            assert_usage_matches(get_usage(channel, "acme"), requests)
    finally:
        stop(second)


def test_an_acknowledged_export_survives_a_crash(own_costd):
    with own_costd.channel() as channel:
        export(own_costd, [final_span(1), final_span(2)])
    own_costd.proc.send_signal(signal.SIGKILL)
    own_costd.proc.wait(timeout=5)
    assert ledger_rows(own_costd.db_path) == 2
