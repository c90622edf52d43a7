"""python -m workers: one inference worker serving WorkerService, registered in Redis by lease."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from llmmesh import metrics, queue, redis_acl, server, telemetry
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity
from llmmesh.supervisor import Supervisor, redis_check
from llmmesh.catalog import CatalogError, CatalogFile, catalog_path
from llmmesh.v1 import worker_pb2, worker_pb2_grpc
from workers.capacity import report_capacity
from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.hosting import ModelHost
from workers.metrics import WorkerMetrics
from workers.servicer import WorkerServicer

log = logging.getLogger("workers")
LEASE_TTL_S = 10
FAIL_AFTER_STEPS_ENV = "LLMMESH_TEST_FAIL_AFTER_STEPS"
STEP_DELAY_MS_ENV = "LLMMESH_TEST_STEP_DELAY_MS"


def _args() -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m workers")
    p.add_argument("--listen", default=env("LLMMESH_WORKER_LISTEN", "127.0.0.1:50061"))
    p.add_argument("--redis-url", default=env("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--otlp-endpoint", default=env("LLMMESH_OTLP_ENDPOINT"))
    p.add_argument("--advertise", default=env("LLMMESH_WORKER_ADVERTISE"),
                   help="address routers should dial (default: the listen address)")
    p.add_argument("--worker-id", default=env("LLMMESH_WORKER_ID", f"{socket.gethostname()}-{os.getpid()}"))
    p.add_argument("--catalog", default=catalog_path(),
                   help="the model catalog (LLMMESH_MODELS_FILE; default config/models.toml)")
    p.add_argument("--models", default=env("LLMMESH_WORKER_MODELS", ""),
                   help="comma-separated catalog models this worker may serve ('' = all)")
    p.add_argument("--preload", "--model", dest="preload",
                   default=env("LLMMESH_MODEL", ""),
                   help="comma-separated models loaded at start (pinned ones always are; "
                        "default: the catalog's default when this worker serves it)")
    p.add_argument("--memory-mib", type=int, default=int(env("LLMMESH_WORKER_MEMORY_MIB", "0")),
                   help="budget for weights + KV pools of the loaded models (0 = no budget); "
                        "idle models are unloaded, least recently used first, to stay within it")
    p.add_argument("--device", default=env("LLMMESH_DEVICE", "cpu"))
    p.add_argument("--dtype", default=env("LLMMESH_DTYPE", "float32"))
    p.add_argument("--max-num-seqs", type=int, default=int(env("LLMMESH_MAX_NUM_SEQS", "32")))
    p.add_argument("--kv-cache-mib", type=int, default=int(env("LLMMESH_KV_CACHE_MIB", "512")),
                   help="each model's KV pool unless its catalog entry sets kv_cache_mib")
    p.add_argument("--kv-cache-dtype", default=env("LLMMESH_KV_CACHE_DTYPE", "auto"),
                   choices=("auto", "float32", "float16", "bfloat16"),
                   help="the KV cache's element type (auto: --dtype); float16 holds twice the "
                        "tokens in the same --kv-cache-mib")
    p.add_argument("--block-size", type=int, default=int(env("LLMMESH_BLOCK_SIZE", "16")))
    p.add_argument("--batch-tokens-with-interactive", type=int,
                   default=int(env("LLMMESH_BATCH_TOKENS_WITH_INTERACTIVE", "8")),
                   help="batch-class tokens per step while interactive requests are present (0: no cap)")
    p.add_argument("--batch-step-budget-ms", type=float,
                   default=float(env("LLMMESH_BATCH_STEP_BUDGET_MS", "30")),
                   help="plan steps holding batch work to end within this time (0: no time cap)")
    p.add_argument("--batch-step-budget-ms-after-interactive", type=float,
                   default=float(env("LLMMESH_BATCH_STEP_BUDGET_MS_AFTER_INTERACTIVE", "15")),
                   help="plan steps holding only batch work within this time for "
                        "--interactive-recent-s after interactive work was last present "
                        "(0: --batch-step-budget-ms at all times)")
    p.add_argument("--interactive-recent-s", type=float,
                   default=float(env("LLMMESH_INTERACTIVE_RECENT_S", "10")),
                   help="how long after interactive work the shorter batch-only step applies")
    p.add_argument("--batch-ms-with-interactive", type=float,
                   default=float(env("LLMMESH_BATCH_MS_WITH_INTERACTIVE", "10")),
                   help="predicted ms batch work may add to a step holding interactive work")
    p.add_argument("--interactive-slowdown", type=float,
                   default=float(env("LLMMESH_INTERACTIVE_SLOWDOWN", "1.5")),
                   help="batch work may make a step holding interactive work at most this many "
                        "times the interactive work's own predicted step (0: off)")
    p.add_argument("--batch-nice", type=int, default=int(env("LLMMESH_BATCH_NICE", "10")),
                   help="CPU: nice value for steps holding only batch work (0: off)")
    p.add_argument("--threads", type=int, default=int(env("LLMMESH_THREADS", "0")) or None)
    metrics.add_arguments(p)
    return p.parse_args()


async def keep_lease(redis: aioredis.Redis, worker_id: str, info) -> None:
    """Renew this worker's registration (`info()`: its current contents); routers drop a
    worker whose lease lapses."""
    while True:
        try:
            await redis.set(queue.worker_key(worker_id), json.dumps(info()), ex=LEASE_TTL_S)
        except RedisError as exc:
            log.warning("lease renewal failed: %s", exc)
        await asyncio.sleep(LEASE_TTL_S / 3)


async def publish_cache_index(redis: aioredis.Redis, worker_id: str, engine: AsyncEngine,
                              interval_s: float = 1.0) -> None:
    """Mirror the engine's newest cached block hashes (of every loaded model: the gateway's
    salt names the model, so they never collide) into Redis, where every router reads them for
    prefix-affinity placement (one index shared by all routers and gateways)."""
    key, last = queue.worker_cache_key(worker_id), None
    while True:
        hashes = tuple(h for load in engine.loads().values() for h in load.cached_block_hashes)
        try:
            async with redis.pipeline(transaction=True) as pipe:
                if hashes != last:
                    pipe.delete(key)
                    if hashes:
                        pipe.sadd(key, *map(str, hashes))
                pipe.expire(key, LEASE_TTL_S)
                await pipe.execute()
            last = hashes
        except RedisError as exc:
            log.warning("cache index update failed: %s", exc)
        await asyncio.sleep(interval_s)


async def main() -> None:
    args = _args()
    server.configure_logging("worker")
    identity = MeshIdentity.from_env(Role.WORKER)   # before the model: a missing cert fails fast
    tracer = telemetry.setup_tracing("llmmesh-worker", args.otlp_endpoint, identity)
    base = EngineConfig(device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                        block_size=args.block_size, kv_cache_bytes=args.kv_cache_mib << 20,
                        max_num_seqs=args.max_num_seqs, num_threads=args.threads,
                        batch_tokens_with_interactive=args.batch_tokens_with_interactive,
                        batch_step_budget_ms=args.batch_step_budget_ms or None,
                        batch_step_budget_ms_after_interactive=(
                            args.batch_step_budget_ms_after_interactive or None),
                        interactive_recent_s=args.interactive_recent_s,
                        batch_ms_with_interactive=args.batch_ms_with_interactive,
                        interactive_slowdown=args.interactive_slowdown,
                        batch_nice=args.batch_nice or None)
    try:
        catalog = CatalogFile(args.catalog)
    except (CatalogError, OSError) as exc:
        raise SystemExit(f"worker: {exc}") from None
    serve = [m for m in args.models.split(",") if m] or None
    for name in serve or ():
        if name not in catalog.current().models:
            raise SystemExit(f"worker: --models names {name!r}, which is not in {args.catalog} "
                             f"(known: {', '.join(catalog.current().names)})")
    host = ModelHost(catalog, base, serve=serve, memory_budget_bytes=args.memory_mib << 20)
    preload = [m for m in args.preload.split(",") if m]
    if not preload and catalog.current().default in host.servable():
        preload = [catalog.current().default]
    await host.start(preload)
    engine = host.engine
    if os.environ.get(FAIL_AFTER_STEPS_ENV):
        _fail_after_steps(engine, int(os.environ[FAIL_AFTER_STEPS_ENV]))
    if os.environ.get(STEP_DELAY_MS_ENV):
        _delay_steps(engine, float(os.environ[STEP_DELAY_MS_ENV]))
    if args.metrics_port >= 0:
        worker_metrics = WorkerMetrics(CollectorRegistry(), engine, args.worker_id, host)
        engine.on_step = worker_metrics.on_step
        metrics.start(args, worker_metrics.registry)
    for name in engine.models:
        info = engine.core_of(name).cache_info
        log.info("%s KV cache: %d blocks of %d tokens (%.1f MiB), max context %d", name,
                 info.num_blocks, info.block_size, info.kv_cache_bytes / 2**20, info.max_model_len)
    device_type = args.device if args.device != "cuda" else f"cuda:{_cuda_name()}"
    # Uptime reports from here on: costd bills idle capacity as uptime minus attributed time.
    capacity = asyncio.create_task(report_capacity(tracer, args.worker_id, device_type,
                                                   loading=host.take_loading_seconds))
    # socket_timeout: a hung Redis fails a write in seconds instead of stalling the engine's output.
    redis = aioredis.Redis.from_url(redis_acl.service_url(args.redis_url, "worker"),
                                    decode_responses=True, socket_connect_timeout=2.0,
                                    socket_timeout=5.0)
    # The same connection pool writes the result streams of requests the router routes here.
    servicer = WorkerServicer(host, args.worker_id, device_type, tracer, results=redis)
    supervisor = Supervisor()
    supervisor.add_check("redis", redis_check(redis))
    supervisor.add_check("engine", engine_check(engine))

    # This process's id in the lease: routers replace their handle when it changes (a restart
    # at the same advertised address must not inherit the old one's circuit or channel).
    incarnation = uuid.uuid4().hex[:12]

    def ready(address: str) -> None:
        def lease() -> dict:
            return {"worker_id": args.worker_id, "address": args.advertise or address,
                    "incarnation": incarnation,
                    "models": host.lease_models(),
                    "max_inflight": args.max_num_seqs + max(2, args.max_num_seqs // 4),
                    # Seats that run at once: the rest of max_inflight waits in the engine
                    # (the gateways' wait bound counts it as queued: llmmesh.drain).
                    "max_running": args.max_num_seqs,
                    "device_type": device_type}
        supervisor.start("lease", lambda: keep_lease(redis, args.worker_id, lease))
        supervisor.start("cache-index", lambda: publish_cache_index(redis, args.worker_id, engine))
        supervisor.start("keep-alive", host.keep_alive_loop)

    async def close():
        await supervisor.stop()
        with contextlib.suppress(RedisError):
            await redis.delete(queue.worker_key(args.worker_id), queue.worker_cache_key(args.worker_id))
        await redis.aclose()
        await engine.shutdown()
        capacity.cancel()  # reports the final partial interval before tracing flushes
        with contextlib.suppress(asyncio.CancelledError):
            await capacity
        telemetry.shutdown_tracing()

    await server.serve(server.ServiceSpec(
        servicers=[(worker_pb2_grpc.add_WorkerServiceServicer_to_server, servicer)],
        service_names=[worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name],
        on_shutdown=[close], identity=identity, healthy=supervisor.healthy), args.listen, ready=ready)


def engine_check(engine: AsyncEngine):
    """Health: NOT_SERVING while the engine's steps fail (until one succeeds again)."""
    async def steps_succeed() -> bool:
        return engine.num_failed_steps == 0
    return steps_succeed


def _fail_after_steps(engine: AsyncEngine, num_steps: int) -> None:
    """Tests only (the chaos suite's F7): every forward pass after the first `num_steps` of the
    loaded models raises, as a device fault would."""
    log.warning("%s=%d: the engine's forward passes will fail (fault injection for tests)",
                FAIL_AFTER_STEPS_ENV, num_steps)
    done = [0]
    for name in engine.models:
        runner = engine.core_of(name).runner
        execute = runner.execute

        def failing(scheduler_output, execute=execute):
            done[0] += 1
            if done[0] > num_steps:
                raise RuntimeError(f"injected fault: forward pass {done[0]} after {num_steps}")
            return execute(scheduler_output)
        runner.execute = failing


def _delay_steps(engine: AsyncEngine, delay_ms: float) -> None:
    """Tests only (the chaos suite: F2's slow worker, and a tiny model paced like a real one):
    every forward pass of the loaded models takes `delay_ms` longer, as a throttled device
    would (on the engine's thread, so the servicer still answers, aborts and cancels)."""
    log.warning("%s=%g: every forward pass is slowed down (fault injection for tests)",
                STEP_DELAY_MS_ENV, delay_ms)
    for name in engine.models:
        runner = engine.core_of(name).runner
        execute = runner.execute

        def slow(scheduler_output, execute=execute):
            time.sleep(delay_ms / 1000)
            return execute(scheduler_output)
        runner.execute = slow


def _cuda_name() -> str:
    import torch
    return torch.cuda.get_device_name(0).replace(" ", "-")


if __name__ == "__main__":
    asyncio.run(main())
