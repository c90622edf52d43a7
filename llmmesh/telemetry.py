"""OpenTelemetry set-up shared by every service: OTLP/gRPC span export and W3C propagation."""
from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity, channel_credentials, channel_options
from llmmesh.vocab import (REQUEST_MAX_TOKENS, REQUEST_SEED, REQUEST_STOP_SEQUENCES,
                           REQUEST_TEMPERATURE, REQUEST_TOP_K, REQUEST_TOP_P)

_PROPAGATOR = TraceContextTextMapPropagator()

_provider: TracerProvider | None = None


def setup_tracing(service_name: str, otlp_endpoint: str | None,
                  identity: MeshIdentity | None = None) -> trace.Tracer:
    """Install a TracerProvider exporting to `otlp_endpoint`: host:port, or several separated
    by commas (costd plus a tracing backend, say); no export when empty. Exports go over mutual
    TLS as `identity`, to receivers whose certificate names the costd role (costd decides what
    to bill by the sender's role, so spans must carry it)."""
    global _provider
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    for endpoint in filter(None, (otlp_endpoint or "").split(",")):
        security = ({"insecure": True} if identity is None else
                    {"credentials": channel_credentials(identity),
                     "channel_options": tuple(channel_options(Role.COSTD))})
        # A short delay keeps bills fresh; the exporter retries UNAVAILABLE with backoff itself.
        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint.strip(), **security),
            schedule_delay_millis=200, max_export_batch_size=256))
    _provider = provider
    trace.set_tracer_provider(provider)
    return provider.get_tracer(service_name)


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.force_flush(5000)
        _provider.shutdown()


def inject_traceparent() -> dict[str, str]:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier


def extract_context(carrier: Mapping[str, str]) -> otel_context.Context:
    return _PROPAGATOR.extract(dict(carrier))


def span_name(operation: str, model: str) -> str:
    """A GenAI span's name by the conventions: `{gen_ai.operation.name} {gen_ai.request.model}`."""
    return f"{operation} {model}"


def request_attributes(sampling: dict) -> dict:
    """The request's parameters as gen_ai.request.* attributes (unset ones left out)."""
    out = {REQUEST_MAX_TOKENS: int(sampling["max_tokens"]),
           REQUEST_TEMPERATURE: float(sampling.get("temperature") or 0.0),
           REQUEST_TOP_P: float(sampling.get("top_p") or 1.0)}
    if sampling.get("top_k"):
        out[REQUEST_TOP_K] = float(sampling["top_k"])
    if sampling.get("seed") is not None:
        out[REQUEST_SEED] = int(sampling["seed"])
    if sampling.get("stop"):
        out[REQUEST_STOP_SEQUENCES] = list(sampling["stop"])
    return out
