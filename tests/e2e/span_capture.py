"""An in-test OTLP/gRPC TraceService that keeps every span it receives (a tracing backend
stand-in for assertions; costd still receives the same spans)."""
from __future__ import annotations

import threading
from concurrent import futures

import grpc

from llmmesh import mtls
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = list(x.string_value for x in v.array_value.values) if kind == "array_value" \
            else getattr(v, kind)
    return out


class SpanCapture(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        # Services export over mutual TLS to a costd identity: this stands where a tracing
        # backend behind the mesh's collector would.
        self.port = self.server.add_secure_port(
            "127.0.0.1:0", mtls.server_credentials(MeshIdentity.from_env(Role.COSTD)))
        self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next((kv.value.string_value for kv in rs.resource.attributes
                                if kv.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans.append({"service": service, "name": span.name,
                                           "trace_id": span.trace_id.hex(),
                                           "span_id": span.span_id.hex(),
                                           "parent_span_id": span.parent_span_id.hex(),
                                           "attributes": _attrs(span)})
        return trace_service_pb2.ExportTraceServiceResponse()

    def for_request(self, request_id: str) -> list[dict]:
        """The spans of one request, found by the id its client was told (the gateway's span
        maps it to the mesh's own id, which the router and worker spans carry)."""
        with self.lock:
            mesh_ids = {s["attributes"].get("llmmesh.request.id") for s in self.spans
                        if s["attributes"].get("llmmesh.request.client_id") == request_id}
            return [s for s in self.spans if s["attributes"].get("llmmesh.request.id") in mesh_ids]

    def stop(self):
        self.server.stop(0)
