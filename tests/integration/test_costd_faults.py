"""Senders retry, costd dedupes: 3× every export through a proxy that fails 20% of calls, and
kill -9 mid-ingest — the ledger still equals the ground truth exactly, and stays sound.

The fault injector is a small gRPC proxy between the real OTel SDK exporter and a real costd,
so no test-only switch exists in costd itself. Half its failures happen before forwarding
(the export never reached costd), half after (costd committed but the answer was lost — the
case that makes idempotency necessary). Each carries a RetryInfo of 10 ms, which the SDK
exporter honours, so retries are fast.
"""
from __future__ import annotations

import random
import sqlite3
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from decimal import Decimal

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from costd_proc import export_by_sender, kill, start_costd, stop
from llmmesh import mtls
from llmmesh.identity import Role
from llmmesh.launcher import free_port
from llmmesh.mtls import MeshIdentity
from llmmesh.v1 import cost_pb2, cost_pb2_grpc

pytestmark = pytest.mark.timeout(90)
S = 1_000_000_000
T0 = 1_735_689_600  # 2025-01-01T00:00:00Z
EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


@dataclass(frozen=True)
class Truth:
    request_id: str
    tenant_id: str
    prompt: int
    cached: int
    completion: int
    prefill_ns: int
    decode_ns: int
    end_ns: int


def ground_truth(seed: int, n: int) -> list[Truth]:
    rng = random.Random(seed)
    truth = []
    for i in range(n):
        prompt = rng.randint(1, 3000)
        truth.append(Truth(f"req-{seed}-{i}", rng.choice(["acme", "globex", "initech"]), prompt,
                           rng.randint(0, prompt), rng.randint(0, 400),
                           rng.randint(0, 2 * S), rng.randint(0, 9 * S), (T0 + 10 + i) * S))
    return truth


def attributes(t: Truth) -> dict:
    return {"llmmesh.usage.final": True, "llmmesh.request.id": t.request_id,
            "llmmesh.tenant.id": t.tenant_id, "gen_ai.request.model": "smollm2-135m-instruct",
            "llmmesh.request.class": "batch", "gen_ai.usage.input_tokens": t.prompt,
            "gen_ai.usage.cache_read.input_tokens": t.cached,
            "gen_ai.usage.output_tokens": t.completion,
            "llmmesh.prefill.device_seconds": t.prefill_ns / S,
            "llmmesh.decode.device_seconds": t.decode_ns / S, "llmmesh.device.type": "cpu",
            "llmmesh.worker.id": "w0", "gen_ai.response.finish_reasons": ["stop"]}


def ledger_rows(db: str) -> tuple[set, set]:
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        usage = set(conn.execute(
            "SELECT request_id, tenant_id, prompt_tokens, cached_prompt_tokens, "
            "completion_tokens, prefill_device_ns, decode_device_ns, end_unix_ns "
            "FROM usage_records"))
        capacity = set(conn.execute("SELECT interval_id, start_unix_ns, end_unix_ns "
                                    "FROM capacity_intervals"))
        return usage, capacity
    finally:
        conn.close()


def as_rows(truth: list[Truth]) -> set:
    return {(t.request_id, t.tenant_id, t.prompt, t.cached, t.completion, t.prefill_ns,
             t.decode_ns, t.end_ns) for t in truth}


class FaultyProxy(grpc.GenericRpcHandler):
    """Forwards raw OTLP exports to costd; answers UNAVAILABLE to `fail_rate` of the calls."""

    def __init__(self, costd, fail_rate: float, seed: int) -> None:
        self.costd = costd
        self.rng, self.lock = random.Random(seed), threading.Lock()
        self.fate = {"before": 0, "after": 0, "ok": 0}
        self.fail_rate = fail_rate

    def _unavailable(self, context, where: str):
        info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=10_000_000))
        context.set_trailing_metadata((("google.rpc.retryinfo-bin", info.SerializeToString()),))
        context.abort(grpc.StatusCode.UNAVAILABLE, f"injected fault ({where} forwarding)")

    def service(self, details):
        if details.method != EXPORT:
            return None

        def export(request: bytes, context):
            with self.lock:
                roll = self.rng.random()
            where = ("before" if roll < self.fail_rate / 2 else
                     "after" if roll < self.fail_rate else "ok")
            with self.lock:
                self.fate[where] += 1
            if where == "before":
                self._unavailable(context, where)
            # Each resource's spans as its own sender: costd bills usage from routers only.
            answer = export_by_sender(self.costd, trace_service_pb2.ExportTraceServiceRequest.FromString(request))
            if where == "after":  # costd committed; the sender never hears so
                self._unavailable(context, where)
            return answer.SerializeToString()

        return grpc.unary_unary_rpc_method_handler(export)


def sdk_batches(truth: list[Truth], per_batch: int) -> list[list]:
    """The SDK's own ReadableSpans: usage spans plus one worker's capacity intervals."""
    memory = InMemorySpanExporter()

    def tracer_of(service: str):
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        return provider.get_tracer("tests")
    tracer = tracer_of("router")
    for t in truth:
        tracer.start_span("llmmesh.request", start_time=t.end_ns - S,
                          attributes=attributes(t)).end(end_time=t.end_ns)
    tracer = tracer_of("llmmesh-worker")
    for i in range(10):
        start = (T0 + 10 * i) * S
        tracer.start_span("llmmesh.capacity", start_time=start, attributes={
            "llmmesh.worker.id": "w0", "llmmesh.device.type": "cpu",
            "llmmesh.capacity.final": True,
            "llmmesh.capacity.interval.id": f"w0:{start}"}).end(end_time=start + 10 * S)
    spans = memory.get_finished_spans()
    return [list(spans[i:i + per_batch]) for i in range(0, len(spans), per_batch)]


def test_three_sends_through_20_percent_unavailable_equal_ground_truth(tmp_path):
    costd = start_costd(str(tmp_path / "ledger.sqlite"), tmp_path / "costd.log")
    proxy = FaultyProxy(costd, fail_rate=0.2, seed=11)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[proxy])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        truth = ground_truth(seed=5, n=90)
        batches = sdk_batches(truth, per_batch=10)

        def send_all() -> list:
            exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=20)
            try:
                return [exporter.export(batch) for batch in batches]
            finally:
                exporter.shutdown()

        # Three senders at once: every export arrives 3 times, often in one group commit.
        with futures.ThreadPoolExecutor(3) as pool:
            results = [r for rs in pool.map(lambda _: send_all(), range(3)) for r in rs]
        assert set(results) == {SpanExportResult.SUCCESS}
        assert proxy.fate["before"] > 0 and proxy.fate["after"] > 0  # faults really happened
        usage, capacity = ledger_rows(costd.db)
        assert usage == as_rows(truth)
        assert len(capacity) == 10
        with costd.channel() as channel:
            response = cost_pb2_grpc.CostServiceStub(channel).GetInvoice(
                cost_pb2.GetInvoiceRequest(query=cost_pb2.BillingQuery(
                    start_unix_s=T0, end_unix_s=T0 + 3600)), timeout=10)
        for invoice in response.invoices:
            mine = [t for t in truth if t.tenant_id == invoice.tenant_id]
            assert invoice.prompt_tokens == sum(t.prompt for t in mine)
            assert invoice.completion_tokens == sum(t.completion for t in mine)
            # the shipped price book: cpu at $0.10/h
            expected = sum(Decimal(t.prefill_ns + t.decode_ns) for t in mine) * Decimal(
                "0.10") / (3600 * S)
            assert abs(Decimal(invoice.total) - expected) <= Decimal("0.000000002")
    finally:
        server.stop(None)
        stop(costd)


def raw_request(truth: list[Truth]) -> trace_service_pb2.ExportTraceServiceRequest:
    def kv(key, value):
        if isinstance(value, bool):
            return KeyValue(key=key, value=AnyValue(bool_value=value))
        if isinstance(value, int):
            return KeyValue(key=key, value=AnyValue(int_value=value))
        if isinstance(value, float):
            return KeyValue(key=key, value=AnyValue(double_value=value))
        if isinstance(value, list):
            return KeyValue(key=key, value=AnyValue(array_value={"values": [
                {"string_value": v} for v in value]}))
        return KeyValue(key=key, value=AnyValue(string_value=value))

    spans = [trace_pb2.Span(name="llmmesh.request", span_id=i.to_bytes(8, "big"),
                            trace_id=b"\x01" * 16, start_time_unix_nano=t.end_ns - S,
                            end_time_unix_nano=t.end_ns,
                            attributes=[kv(k, v) for k, v in attributes(t).items()])
             for i, t in enumerate(truth, 1)]
    return trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[{"scope_spans": [{"spans": spans}]}])


def test_kill_9_mid_ingest_loses_nothing_senders_retry(tmp_path):
    db, log = str(tmp_path / "ledger.sqlite"), tmp_path / "costd.log"
    address = f"127.0.0.1:{free_port()}"
    costd = start_costd(db, log, address=address)
    truth = ground_truth(seed=9, n=1200)
    requests = [raw_request(truth[i:i + 30]) for i in range(0, len(truth), 30)]
    acked, failures = threading.Event(), []

    def sender() -> None:
        """An OTLP sender: each export is retried until costd acknowledges it."""
        with mtls.channel(address, MeshIdentity.from_env(Role.ROUTER), Role.COSTD) as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            for n, request in enumerate(requests):
                while True:
                    try:
                        stub.Export(request, timeout=2)
                        break
                    except grpc.RpcError as error:
                        failures.append(error.code())
                        time.sleep(0.05)
                if n == 10:
                    acked.set()

    thread = threading.Thread(target=sender)
    thread.start()
    try:
        assert acked.wait(30)
        kill(costd)  # mid-ingest: the sender is still sending
        restarted = start_costd(db, log, address=address)
        thread.join(60)
        assert not thread.is_alive()
        assert failures, "the sender never saw costd die: the kill was not mid-ingest"
        stop(restarted)
    finally:
        stop(costd)
    usage, _ = ledger_rows(db)  # integrity_check inside
    assert usage == as_rows(truth)
