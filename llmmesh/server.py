"""gRPC server bootstrap shared by every service: health, reflection, error mapping, graceful stop."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from datetime import datetime, timezone
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace
from grpc_reflection.v1alpha import reflection

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from llmmesh.errors import MeshError
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity, RoleInterceptor, aio_channel, server_credentials

log = logging.getLogger("llmmesh.server")


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str):
    if isinstance(exc, MeshError):
        await context.abort(exc.code, exc.message, trailing_metadata=exc.trailing_metadata())
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"queue store unavailable ({type(exc).__name__}); retry shortly")
    log.exception("unhandled error in %s", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see server logs")


class _Undecodable:
    """A request whose bytes did not parse (bad UTF-8 in a string, a truncated message)."""

    def __init__(self, error: Exception):
        self.reason = str(error).rsplit(": ", 1)[-1] or type(error).__name__


def _safe(deserialize):
    # gRPC would answer UNKNOWN with the parser's exception text: parse here and let the
    # handler answer INVALID_ARGUMENT instead.
    if deserialize is None:
        return None

    def parse(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as exc:
            return _Undecodable(exc)
    return parse


async def _refuse_undecodable(context, request) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request: cannot be parsed ({request.reason}); strings must be UTF-8")


def _wrap_unary(behavior, method: str):
    async def wrapper(request, context):
        await _refuse_undecodable(context, request)
        try:
            return await behavior(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - the one place that maps errors
            await _abort(context, exc, method)
    return wrapper


def _wrap_stream(behavior, method: str):
    async def wrapper(request, context):
        await _refuse_undecodable(context, request)
        try:
            async for item in behavior(request, context):
                yield item
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc, method)
    return wrapper


class HealthServicer(health.aio.HealthServicer):
    """grpc.health.v1 as the stock async servicer, with List, and Watch as a stream handler.

    The stock Watch writes with context.write() instead of yielding, which the interceptors
    here (role checks, error mapping: they wrap stream handlers as async generators) cannot
    relay, so every Watch ended INTERNAL; and List is left unimplemented (INTERNAL through the
    error mapping). Kubernetes' probes use Check, but Watch is what long-lived clients and
    meshes use to follow a service's status."""

    async def List(self, request, context) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in self._server_status.items()})

    async def Watch(self, request, context):
        service = request.service
        condition = self._server_watchers[service]
        self._watcher_count_by_service[service] += 1
        last = None
        try:
            async with condition:
                while True:
                    status = self._server_status.get(
                        service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                    if status != last:
                        yield health_pb2.HealthCheckResponse(status=status)
                        last = status
                    await condition.wait()
        finally:
            self._watcher_count_by_service[service] -= 1
            if self._watcher_count_by_service[service] == 0:
                del self._server_watchers[service]
                del self._watcher_count_by_service[service]


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps MeshError subclasses to their status code; anything else to INTERNAL without a trace."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                _safe(handler.request_deserializer), handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method),
                _safe(handler.request_deserializer), handler.response_serializer)
        return handler


@dataclass
class ServiceSpec:
    """What a service hosts: (add_XServicer_to_server, servicer) pairs and their full names.

    An internal service names its `identity`: its port then serves mutual TLS only, and each
    method answers only the roles llmmesh.identity allows. Only the public gateway sets
    `public` instead (API keys authorize its callers), with server TLS when given `public_tls`
    (certificate and key paths).
    """

    servicers: list[tuple[Callable, object]]
    service_names: list[str]
    on_shutdown: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    identity: MeshIdentity | None = None
    public: bool = False
    public_tls: tuple[str, str] | None = None
    # Whether the service can do its job now (llmmesh.supervisor.Supervisor.healthy): polled,
    # and grpc.health.v1 says NOT_SERVING while it answers False.
    healthy: Callable[[], Awaitable[bool]] | None = None
    # gRPC server options over the internal defaults (a public port: public_options()).
    options: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        if (self.identity is None) == (not self.public):
            raise ValueError("a service is either internal (identity) or public, not both or neither")


# Internal hops carry whole prompts and token lists between trusted services, and their
# callers (mutual TLS, named roles) may ping as often as every second: a router finds a stopped
# worker under its calls by keepalive (router.registry.WORKER_KEEPALIVE), which gRPC's default
# (pings at most every 5 min without data, 2 strikes, then GOAWAY) would punish.
INTERNAL_OPTIONS = (("grpc.max_receive_message_length", 64 * 1024 * 1024),
                    ("grpc.max_send_message_length", 64 * 1024 * 1024),
                    ("grpc.so_reuseport", 0),
                    ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
                    ("grpc.http2.max_ping_strikes", 0))


def public_options(*, max_message_bytes: int, max_streams_per_connection: int,
                   idle_connection_s: float, max_metadata_bytes: int = 16 * 1024
                   ) -> tuple[tuple[str, int], ...]:
    """Limits for a port anyone may reach: message and metadata sizes, concurrent streams per
    connection, keepalive rules a client must keep (pings at most every 30 s without calls;
    two strikes and the connection is closed), dead peers found by the server's own pings, and
    connections with no call for `idle_connection_s` closed."""
    return (("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_metadata_size", max_metadata_bytes),
            ("grpc.max_concurrent_streams", max_streams_per_connection),
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", 30_000),
            ("grpc.http2.max_ping_strikes", 2),
            ("grpc.max_connection_idle_ms", int(idle_connection_s * 1000)))


def _add_port(server: grpc.aio.Server, spec: ServiceSpec, listen: str) -> int:
    if spec.identity is not None:
        return server.add_secure_port(listen, server_credentials(spec.identity))
    if spec.public_tls:
        cert, key = (open(p, "rb").read() for p in spec.public_tls)
        return server.add_secure_port(listen, grpc.ssl_server_credentials([(key, cert)]))
    return server.add_insecure_port(listen)


async def serve(spec: ServiceSpec, listen: str, *, grace_s: float = 5.0,
                ready: Callable[[str], None] | None = None,
                stop_event: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or stop_event), then drain calls for `grace_s` and shut down."""
    # Roles first: a refused caller never reaches the servicer or its error mapping.
    interceptors = [RoleInterceptor()] if spec.identity else []
    options = dict(INTERNAL_OPTIONS) | dict(spec.options)
    server = grpc.aio.server(interceptors=[*interceptors, ErrorMappingInterceptor()],
                             options=list(options.items()))
    for add, servicer in spec.servicers:
        add(servicer, server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*spec.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    # The shutdown hooks run also when it could not start (its port taken): they stop what the
    # service started before it (its supervised loops, an HTTP front), and the process exits
    # instead of waiting on them.
    try:
        port = _add_port(server, spec, listen)
        if port == 0:
            raise RuntimeError(f"cannot listen on {listen}")
        address = f"{listen.rsplit(':', 1)[0]}:{port}"
        await server.start()
        for name in ["", *spec.service_names]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        watch = asyncio.create_task(_report_health(spec, health_servicer)) if spec.healthy else None
        log.info("serving %s on %s", ", ".join(spec.service_names), address)
        if ready:
            ready(address)
        stop = stop_event or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping: draining calls for up to %.1fs", grace_s)
        if watch is not None:
            watch.cancel()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace_s)
    finally:
        for hook in spec.on_shutdown:
            await hook()


HEALTH_POLL_S = 0.5


async def _report_health(spec: ServiceSpec, health_servicer) -> None:
    serving = True
    while True:
        await asyncio.sleep(HEALTH_POLL_S)
        try:
            now = await spec.healthy()
        except Exception:  # noqa: BLE001 - a health source that fails says "not serving"
            log.exception("health source failed")
            now = False
        if now != serving:
            serving = now
            status = (health_pb2.HealthCheckResponse.SERVING if now
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            log.warning("health: %s", health_pb2.HealthCheckResponse.ServingStatus.Name(status))
            for name in ["", *spec.service_names]:
                await health_servicer.set(name, status)


def _probe_channel(address: str, caller: MeshIdentity | None, server_role: Role | None):
    if caller is None or server_role is None:
        return grpc.aio.insecure_channel(address)
    return aio_channel(address, caller, server_role)


async def wait_serving(address: str, timeout_s: float, service: str = "", *,
                       caller: MeshIdentity | None = None, server_role: Role | None = None) -> None:
    """Poll grpc.health.v1 until `service` is SERVING (used by `make up` and tests); an
    internal service is probed over mutual TLS as `caller`, expecting `server_role`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with _probe_channel(address, caller, server_role) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout_s}s")
            await asyncio.sleep(0.1)


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line; inside a span, its trace_id and span_id (OTel's log
    correlation: a log line finds its request's trace, and the trace its log lines)."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname, "service": self.service, "logger": record.name,
               "message": record.getMessage()}
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            out["trace_id"], out["span_id"] = f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(service: str, level: str | None = None, stream=None) -> None:
    """Logs of one service: JSON lines by default (LLMMESH_LOG_FORMAT=text for plain lines);
    the level from LLMMESH_<SERVICE>_LOG_LEVEL, else LLMMESH_LOG_LEVEL, else INFO."""
    env = os.environ
    level = (level or env.get(f"LLMMESH_{service.upper()}_LOG_LEVEL") or env.get("LLMMESH_LOG_LEVEL")
             or "INFO").upper()
    handler = logging.StreamHandler(stream)
    if env.get("LLMMESH_LOG_FORMAT", "json") == "text":
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(JsonLogFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def service_names(*descriptors: Iterable) -> list[str]:
    return [d.full_name for d in descriptors]
