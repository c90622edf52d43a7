"""python -m gateway: the public GatewayService."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from gateway.batch_jobs import BatchJobs
from gateway.frontend import Frontend, FrontendConfig
from gateway.metrics import GatewayMetrics
from gateway.openai_http import HttpServer, OpenAIFront
from gateway.servicer import GatewayServicer
from gateway.tenants import TenantBook, TenantsFileError
from gateway.models import ModelBook
from llmmesh import metrics, redis_acl, server, telemetry
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity
from llmmesh.supervisor import Supervisor, redis_check
from llmmesh.catalog import CatalogError, CatalogFile, catalog_path
from llmmesh.v1 import gateway_pb2, gateway_pb2_grpc


def _args() -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m gateway")
    p.add_argument("--listen", default=env("LLMMESH_GATEWAY_LISTEN", "127.0.0.1:50051"))
    p.add_argument("--redis-url", default=env("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--otlp-endpoint", default=env("LLMMESH_OTLP_ENDPOINT"))
    p.add_argument("--tenants", default=env("LLMMESH_TENANTS_FILE", "config/tenants.toml"))
    p.add_argument("--catalog", default=catalog_path(),
                   help="the model catalog (LLMMESH_MODELS_FILE; default config/models.toml)")
    p.add_argument("--block-size", type=int, default=int(env("LLMMESH_BLOCK_SIZE", "16")))
    p.add_argument("--tls-cert", default=env("LLMMESH_GATEWAY_TLS_CERT"),
                   help="PEM certificate for the public port (plaintext without one)")
    p.add_argument("--tls-key", default=env("LLMMESH_GATEWAY_TLS_KEY"))
    p.add_argument("--http-listen", default=env("LLMMESH_GATEWAY_HTTP_LISTEN", "127.0.0.1:8000"),
                   help="the OpenAI-compatible HTTP front (same TLS as the gRPC port); '' = off")
    p.add_argument("--max-message-mib", type=float,
                   default=float(env("LLMMESH_GATEWAY_MAX_MESSAGE_MIB", "4")),
                   help="largest request on the public port (a prompt the longest context "
                        "holds fits with room; bigger batch jobs go through the files API)")
    p.add_argument("--max-streams-per-tenant", type=int,
                   default=int(env("LLMMESH_GATEWAY_MAX_STREAMS_PER_TENANT", "256")),
                   help="open Generate/Complete calls one tenant may hold on this gateway")
    p.add_argument("--max-streams", type=int,
                   default=int(env("LLMMESH_GATEWAY_MAX_STREAMS", "2048")),
                   help="open Generate/Complete calls on this gateway, all tenants together "
                        "(each holds a Redis connection while it waits for tokens)")
    p.add_argument("--max-streams-per-connection", type=int,
                   default=int(env("LLMMESH_GATEWAY_MAX_STREAMS_PER_CONNECTION", "100")))
    p.add_argument("--max-queue-len", type=int,
                   default=int(env("LLMMESH_GATEWAY_MAX_QUEUE_LEN", "10000")),
                   help="entries each class's queue may hold; beyond, RESOURCE_EXHAUSTED with a "
                        "retry delay (overload is refused at the door, never queued unbounded)")
    p.add_argument("--idle-stream-s", type=float,
                   default=float(env("LLMMESH_GATEWAY_IDLE_STREAM_S", "900")),
                   help="end a call (DEADLINE_EXCEEDED, the request cancelled) that got no "
                        "token or end for this long, deadline or not; 0: never")
    p.add_argument("--idle-connection-s", type=float,
                   default=float(env("LLMMESH_GATEWAY_IDLE_CONNECTION_S", "300")),
                   help="close a client connection with no call for this long")
    p.add_argument("--interactive-max-wait-ms", type=float,
                   default=float(env("LLMMESH_GATEWAY_INTERACTIVE_MAX_WAIT_MS", "0")),
                   help="refuse interactive requests (RESOURCE_EXHAUSTED with a retry delay) while "
                        "the queue would make them wait longer than this for a seat, from the "
                        "routers' drain reports; 0: only --max-queue-len bounds the queue")
    metrics.add_arguments(p)
    args = p.parse_args()
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    for flag, listen in (("--listen", args.listen), ("--http-listen", args.http_listen)):
        host = listen.rsplit(":", 1)[0].strip("[]") if listen else "127.0.0.1"
        if not args.tls_cert and host not in ("127.0.0.1", "localhost", "::1"):
            # API keys in plaintext are readable on the wire: only loopback may go without TLS.
            p.error(f"{flag} {listen} is not loopback: give --tls-cert/--tls-key")
    return args


async def main() -> None:
    args = _args()
    server.configure_logging("gateway")
    # Its own spans go to costd over mutual TLS as the gateway role (never billed from there).
    tracer = telemetry.setup_tracing("llmmesh-gateway", args.otlp_endpoint,
                                     MeshIdentity.from_env(Role.GATEWAY))
    try:
        models = ModelBook(CatalogFile(args.catalog))
    except (CatalogError, OSError, KeyError, ValueError) as exc:
        raise SystemExit(f"gateway: {exc}") from None
    # socket_timeout well above the relay's 500 ms XREAD block: a hung Redis cannot hang a call.
    # Every open call blocks on its own result stream (XREAD) with a pooled connection, so the
    # pool holds --max-streams of them plus room for admission, batch jobs and health.
    redis = aioredis.Redis.from_url(redis_acl.service_url(args.redis_url, "gateway"),
                                    decode_responses=True, socket_timeout=5.0,
                                    # Bytes a writer put in a stream that are not UTF-8 must
                                    # not fail the read (streamauth refuses the entry).
                                    encoding_errors="replace",
                                    socket_connect_timeout=2.0, health_check_interval=10,
                                    max_connections=args.max_streams + 256)
    registry = CollectorRegistry()
    frontend = Frontend(redis, FrontendConfig(block_size=args.block_size,
                                              server_address=args.listen,
                                              max_streams_per_tenant=args.max_streams_per_tenant,
                                              max_streams=args.max_streams,
                                              idle_stream_s=args.idle_stream_s,
                                              max_queue_len=args.max_queue_len,
                                              interactive_max_wait_s=args.interactive_max_wait_ms / 1000),
                        tracer, GatewayMetrics(registry))
    metrics.start(args, registry)
    try:
        tenants = TenantBook(args.tenants)
    except (TenantsFileError, OSError) as exc:
        raise SystemExit(f"gateway: {exc}") from None   # one line, not a traceback
    frontend.metrics.watch_tenants(tenants)
    servicer = GatewayServicer(frontend, tenants, models, models.default,
                               BatchJobs(redis, frontend))

    supervisor = Supervisor()   # health follows Redis, its queue store
    supervisor.add_check("redis", redis_check(redis))
    supervisor.start("epoch", frontend.losses.watch)
    if frontend.config.interactive_max_wait_s:
        supervisor.start("drain", frontend.drain.run)
    tls = (args.tls_cert, args.tls_key) if args.tls_cert else None

    # The OpenAI-compatible door, in this event loop: the same servicer's tenants, models,
    # frontend and batch jobs. It listens before gRPC health says SERVING.
    http = None
    if args.http_listen:
        http = HttpServer(OpenAIFront(frontend, tenants, servicer.models, models.default,
                                      servicer.batch_jobs, healthy=supervisor.healthy).app(),
                          args.http_listen, tls)
        address = await http.start()
        logging.getLogger("gateway").info("OpenAI-compatible HTTP front on %s://%s/v1",
                                          http.scheme, address)

    async def close():
        await supervisor.stop()
        if http is not None:
            await http.stop()
        await redis.aclose()
        telemetry.shutdown_tracing()

    await server.serve(server.ServiceSpec(
        servicers=[(gateway_pb2_grpc.add_GatewayServiceServicer_to_server, servicer)],
        service_names=[gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name],
        on_shutdown=[close], public=True, healthy=supervisor.healthy,
        public_tls=tls, options=server.public_options(
            max_message_bytes=int(args.max_message_mib * 2**20),
            max_streams_per_connection=args.max_streams_per_connection,
            idle_connection_s=args.idle_connection_s)), args.listen)


if __name__ == "__main__":
    asyncio.run(main())
