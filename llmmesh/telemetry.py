"""OpenTelemetry set-up shared by every service: OTLP/gRPC span export and W3C propagation."""
from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as genai
from opentelemetry.semconv.attributes import error_attributes, server_attributes
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity, channel_credentials, channel_options

_PROPAGATOR = TraceContextTextMapPropagator()

# Attribute names: the OTel GenAI semantic conventions (from the conventions package), then
# ours under llmmesh.*.
OPERATION = genai.GEN_AI_OPERATION_NAME
PROVIDER = genai.GEN_AI_PROVIDER_NAME
REQUEST_MODEL = genai.GEN_AI_REQUEST_MODEL
REQUEST_MAX_TOKENS = genai.GEN_AI_REQUEST_MAX_TOKENS
REQUEST_TEMPERATURE = genai.GEN_AI_REQUEST_TEMPERATURE
REQUEST_TOP_P = genai.GEN_AI_REQUEST_TOP_P
REQUEST_TOP_K = genai.GEN_AI_REQUEST_TOP_K
REQUEST_SEED = genai.GEN_AI_REQUEST_SEED
REQUEST_STOP_SEQUENCES = genai.GEN_AI_REQUEST_STOP_SEQUENCES
RESPONSE_ID = genai.GEN_AI_RESPONSE_ID
RESPONSE_MODEL = genai.GEN_AI_RESPONSE_MODEL
INPUT_TOKENS = genai.GEN_AI_USAGE_INPUT_TOKENS
OUTPUT_TOKENS = genai.GEN_AI_USAGE_OUTPUT_TOKENS
CACHE_READ_TOKENS = genai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS
FINISH_REASONS = genai.GEN_AI_RESPONSE_FINISH_REASONS
SERVER_ADDRESS = server_attributes.SERVER_ADDRESS
SERVER_PORT = server_attributes.SERVER_PORT
ERROR_TYPE = error_attributes.ERROR_TYPE
PROVIDER_NAME = "llmmesh"   # gen_ai.provider.name: the mesh serves its own models
CHAT = genai.GenAiOperationNameValues.CHAT.value
TEXT_COMPLETION = genai.GenAiOperationNameValues.TEXT_COMPLETION.value
TENANT_ID = "llmmesh.tenant.id"
REQUEST_ID = "llmmesh.request.id"  # the mesh's own id: tenant/client id/nonce
CLIENT_REQUEST_ID = "llmmesh.request.client_id"  # the id the client sent (or was given)
REQUEST_CLASS = "llmmesh.request.class"
DEVICE_TYPE = "llmmesh.device.type"
WORKER_ID = "llmmesh.worker.id"
PREFILL_DEVICE_S = "llmmesh.prefill.device_seconds"
DECODE_DEVICE_S = "llmmesh.decode.device_seconds"
QUEUE_S = "llmmesh.queue.seconds"  # enqueue to the request's first engine step
QUANTIZATION = "llmmesh.quantization"
USAGE_FINAL = "llmmesh.usage.final"  # set on exactly one span per request: the billing record

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
