"""Prometheus metrics, shared by every service: one registry per process, served on
`--metrics-port` by prometheus_client's own HTTP server (a thread of its own, off the event loop).

Names. The OpenTelemetry GenAI server metrics as Prometheus spells OTel names (dots to
underscores, the unit as a suffix): `gen_ai.server.time_to_first_token` is
`gen_ai_server_time_to_first_token_seconds`, with the semantic conventions' bucket boundaries
and attribute names (`gen_ai_operation_name`, `gen_ai_request_model`, `gen_ai_token_type`). The
mesh's own are `llmmesh_*`: vLLM writes `vllm:*`, but Prometheus reserves colons for recording
rules, so an exporter should not emit them.

Labels stay bounded: `tenant` only where the tenant was authenticated against the tenants file
(the gateway; an unauthenticated caller is never a label value, and the router and costd carry
no tenant label), `class` one of queue.CLASSES, `model` a served model, `worker` a worker id
from the fleet's leases, `outcome` / `error_type` a status name or a fixed vocabulary.
"""
from __future__ import annotations

import logging
import os

from opentelemetry.semconv._incubating.metrics import gen_ai_metrics as semconv
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, start_http_server

from llmmesh.vocab import PROVIDER_NAME

log = logging.getLogger("llmmesh.metrics")
# No `_created` series beside every counter and histogram: Prometheus does not need them, and
# they double what each scrape carries.
disable_created_metrics()

# Bucket boundaries from the GenAI semantic conventions (gen-ai-metrics.md).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                 16777216, 67108864)
# Engine steps: ms-scale on a CPU, sub-ms on a GPU.
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512,
                1.024, 2.048)

def prometheus_name(otel_name: str) -> str:
    """An OTel metric name as Prometheus spells it (the unit suffix is added by the client)."""
    return otel_name.replace(".", "_")


def serve(port: int, registry: CollectorRegistry, host: str = "127.0.0.1") -> int:
    """Serve `registry` at http://host:port/metrics; returns the port (0 picks a free one)."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound


class GenAIServerMetrics:
    """The GenAI server histograms, and the request outcome counter beside them."""

    LABELS = ("gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "tenant",
              "class")

    def __init__(self, registry: CollectorRegistry):
        self.ttft = Histogram(prometheus_name(semconv.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN),
                              "Time to generate the first "
                              "token, from the request's arrival", self.LABELS, unit="seconds",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram(prometheus_name(semconv.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN),
                              "Time per output token "
                              "after the first", self.LABELS, unit="seconds", buckets=TPOT_BUCKETS,
                              registry=registry)
        self.duration = Histogram(prometheus_name(semconv.GEN_AI_SERVER_REQUEST_DURATION),
                                  "Time from the request's "
                                  "arrival to its last token", (*self.LABELS, "error_type"),
                                  unit="seconds", buckets=DURATION_BUCKETS, registry=registry)
        # The conventions name token usage only on the client side (gen_ai.client.token.usage):
        # the gateway records it as the mesh's clients see it.
        self.tokens = Histogram(prometheus_name(semconv.GEN_AI_CLIENT_TOKEN_USAGE),
                                "Tokens per request, by type (input = prompt, output = completion)",
                                (*self.LABELS, "gen_ai_token_type"), buckets=TOKEN_BUCKETS,
                                registry=registry)

    def labels(self, operation: str, model: str, tenant: str, request_class: str) -> tuple:
        return (operation, PROVIDER_NAME, model, tenant, request_class)


def add_arguments(parser, environ=None) -> None:
    """--metrics-port / --metrics-host, the same on every service (defaults from `environ`,
    os.environ when None)."""
    env = os.environ if environ is None else environ
    parser.add_argument("--metrics-port", type=int, default=int(env.get("LLMMESH_METRICS_PORT", -1)),
                        help="serve Prometheus metrics on this port (0: any free one; -1: off)")
    parser.add_argument("--metrics-host", default=env.get("LLMMESH_METRICS_HOST", "127.0.0.1"),
                        help="address the metrics port binds (0.0.0.0 in a pod)")


def start(args, registry: CollectorRegistry) -> int | None:
    """Serve `registry` as the parsed --metrics-* arguments say; the bound port, or None."""
    if args.metrics_port < 0:
        return None
    return serve(args.metrics_port, registry, args.metrics_host)
