"""python -m router: reads the class queues and dispatches to workers (no public API)."""
from __future__ import annotations

import argparse
import asyncio
import os
import socket

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from llmmesh import metrics, redis_acl, server, telemetry
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity
from llmmesh.supervisor import Supervisor, redis_check
from router import faults
from router.dispatcher import Dispatcher, DispatcherConfig
from router.fairness import ClassPolicy
from router.metrics import RouterMetrics
from router.policy import POLICIES, make_policy
from router.registry import WorkerRegistry
from router.shipper import BillingShipper


def _args() -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m router")
    p.add_argument("--listen", default=env("LLMMESH_ROUTER_LISTEN", "127.0.0.1:50052"),
                   help="address of the router's health endpoint")
    p.add_argument("--redis-url", default=env("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--otlp-endpoint", default=env("LLMMESH_OTLP_ENDPOINT"))
    p.add_argument("--costd", default=env("LLMMESH_COSTD_ADDRESS"),
                   help="where billing records are shipped (default: the first OTLP endpoint)")
    p.add_argument("--policy", choices=sorted(POLICIES), default=env("LLMMESH_ROUTER_POLICY", "prefix-affinity"))
    p.add_argument("--consumer", default=env("LLMMESH_ROUTER_ID", f"{socket.gethostname()}-{os.getpid()}"))
    p.add_argument("--claim-idle-ms", type=int, default=int(env("LLMMESH_CLAIM_IDLE_MS", "15000")),
                   help="take over entries another router has not heartbeated for this long")
    p.add_argument("--heartbeat-s", type=float, default=float(env("LLMMESH_HEARTBEAT_S", "3")))
    p.add_argument("--breaker-open-s", type=float, default=float(env("LLMMESH_BREAKER_OPEN_S", "5")),
                   help="after 3 failed attempts on a worker, seconds before one probe is sent")
    p.add_argument("--batch-min-share", type=float, default=float(env("LLMMESH_BATCH_MIN_SHARE", "0.2")))
    p.add_argument("--billing-retention-s", type=float,
                   default=float(env("LLMMESH_BILLING_RETENTION_S", "86400")),
                   help="keep shipped billing records this long, for `llmmesh reconcile`")
    metrics.add_arguments(p)
    return p.parse_args()


async def main() -> None:
    args = _args()
    server.configure_logging("router")
    identity = MeshIdentity.from_env(Role.ROUTER)
    tracer = telemetry.setup_tracing("llmmesh-router", args.otlp_endpoint, identity)
    # redis-py's asyncio pool holds 100 connections by default and then refuses: a router
    # relays every in-flight request with its own Redis calls, so give it room.
    redis = aioredis.Redis.from_url(redis_acl.service_url(args.redis_url, "router"),
                                    decode_responses=True, encoding_errors="replace",
                                    socket_connect_timeout=2.0, health_check_interval=10,
                                    max_connections=2048)
    faults.configure(args.consumer)   # tests only: LLMMESH_TEST_ROUTER_DIE_AT
    registry = WorkerRegistry(redis, identity, breaker_open_s=args.breaker_open_s)
    dispatcher = Dispatcher(redis, registry, make_policy(args.policy),
                            DispatcherConfig(consumer=args.consumer, class_policy=ClassPolicy(
                                batch_min_share=args.batch_min_share),
                                claim_idle_ms=args.claim_idle_ms, heartbeat_s=args.heartbeat_s),
                            tracer)
    costd = args.costd or (args.otlp_endpoint or "").split(",")[0].strip()
    if not costd:
        raise SystemExit("router: no costd to ship bills to: give --costd or --otlp-endpoint")
    shipper = BillingShipper(redis, costd, identity, args.consumer,
                             retention_s=args.billing_retention_s)
    supervisor = Supervisor()
    loops = [("registry", registry.run), ("dispatch", dispatcher.run),
             ("cancels", dispatcher.watch_cancels), ("reclaim", dispatcher.reclaim),
             ("billing", shipper.run), ("epoch", dispatcher.watch_epoch),
             ("drain", dispatcher.publish_drain)]
    if args.metrics_port >= 0:
        dispatcher.metrics = RouterMetrics(CollectorRegistry(), redis,
                                           lambda: registry.workers.values())
        metrics.start(args, dispatcher.metrics.registry)
        loops.append(("metrics", dispatcher.metrics.sample_queues))
    for name, loop in loops:
        supervisor.start(name, loop)
    supervisor.add_check("redis", redis_check(redis))

    async def close():
        await supervisor.stop()
        await registry.close()
        await shipper.close()
        await redis.aclose()
        telemetry.shutdown_tracing()

    # The router serves only grpc.health.v1 (and reflection) so orchestrators can probe it.
    await server.serve(server.ServiceSpec(servicers=[], service_names=[], on_shutdown=[close],
                                          identity=identity, healthy=supervisor.healthy),
                       args.listen)


if __name__ == "__main__":
    asyncio.run(main())
