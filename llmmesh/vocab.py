"""The mesh's shared words, each spelled once: request classes, finish reasons, and the names
of the span attributes every service writes and costd bills from.

Gateway, router, workers and costd all read these from here, so a new word is one change:

- a request class: a member of `RequestClass` (first = most latency-sensitive) and its value
  in common.proto's `RequestClass` enum (`REQUEST_CLASS_<NAME>`). Its queue stream, the
  router's per-class queues and metrics, plan validation (`allowed_classes`), proto
  conversion in every service and the worker's engine priority follow from the member; only
  code that treats a class differently (the router's batch share, the OpenAI service tiers)
  needs a look.
- a finish reason: a member of `FinishReason` and, if clients see it, `FINISH_REASON_<NAME>`.
- a span attribute: one constant below, written where it is known and read where it is billed.
"""
from __future__ import annotations

from enum import StrEnum

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as genai
from opentelemetry.semconv.attributes import error_attributes, server_attributes

from llmmesh.v1 import common_pb2


class RequestClass(StrEnum):
    """How latency-sensitive a request is; it picks the queue, the router's order and the
    worker's priority. Declaration order is priority order."""

    INTERACTIVE = "interactive"
    BATCH = "batch"

    @property
    def proto(self) -> int:
        return _CLASS_PROTO[self]

    @property
    def priority(self) -> int:
        """The worker engine's priority: 0 is served first."""
        return _CLASS_PRIORITY[self]

    @classmethod
    def from_proto(cls, value: int) -> RequestClass:
        """UNSPECIFIED is the documented default (interactive); an unknown number raises
        ValueError."""
        if value == common_pb2.REQUEST_CLASS_UNSPECIFIED:
            return DEFAULT_CLASS
        name = common_pb2.RequestClass.Name(value)   # ValueError for an unknown number
        return cls[name.removeprefix("REQUEST_CLASS_")]


DEFAULT_CLASS = RequestClass.INTERACTIVE
_CLASS_PROTO = {c: common_pb2.RequestClass.Value(f"REQUEST_CLASS_{c.name}") for c in RequestClass}
_CLASS_PRIORITY = {c: i for i, c in enumerate(RequestClass)}
CLASSES = tuple(c.value for c in RequestClass)


class FinishReason(StrEnum):
    """Why a request ended. ERROR travels as a typed error to clients, never as a final."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"

    @property
    def proto(self) -> int:
        return _FINISH_PROTO.get(self, common_pb2.FINISH_REASON_UNSPECIFIED)

    @classmethod
    def from_proto(cls, value: int, default: FinishReason | None = None) -> FinishReason:
        """A proto finish reason as ours; UNSPECIFIED or unknown gives `default` (STOP)."""
        if value != common_pb2.FINISH_REASON_UNSPECIFIED:
            try:
                return cls[common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_")]
            except (ValueError, KeyError):
                pass
        return default or cls.STOP

    @classmethod
    def of(cls, text: str, default: FinishReason | None = None) -> FinishReason:
        """A stored reason (result streams, queue entries) as ours; unknown gives `default`."""
        try:
            return cls(text)
        except ValueError:
            return default or cls.STOP


_FINISH_PROTO = {f: common_pb2.FinishReason.Value(f"FINISH_REASON_{f.name}") for f in FinishReason
                 if f"FINISH_REASON_{f.name}" in common_pb2.FinishReason.keys()}

# Span attribute names: the OTel GenAI semantic conventions (from the conventions package),
# then ours under llmmesh.*.
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
HTTP_ROUTE = "llmmesh.http.route"
END_USER = "llmmesh.end_user"

# Capacity reports: one span per interval of a worker's uptime (workers/capacity.py).
CAPACITY_SPAN = "llmmesh.capacity"
CAPACITY_FINAL = "llmmesh.capacity.final"
CAPACITY_INTERVAL_ID = "llmmesh.capacity.interval.id"
CAPACITY_LOADING_S = "llmmesh.capacity.loading_s"   # seconds of the interval spent loading models
