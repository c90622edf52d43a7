"""The systems a run measures, behind one interface: the mesh (through the gateway), our worker
called directly (no gateway, Redis queue or router: what the mesh adds), and llama.cpp's
llama-server on the same GGUF. A target streams events — an int per chunk of new tokens, then
one usage dict — and can report its load (KV usage, running, waiting) while a run goes on.
"""
from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator

import grpc
import httpx

from bench.cost import costd_bill
from bench.peers.llamacpp import (LlamaServer, ServerBuild, choose_server_build,
                                  llamacpp_version, parse_metrics)
from bench.workload import RequestSpec
from llmmesh import mtls
from llmmesh.identity import Role
from llmmesh.launcher import Mesh, free_port
from llmmesh.mtls import MeshIdentity
from llmmesh.models import DEFAULT_MODEL, resolve_model
from llmmesh.v1 import (common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2,
                        worker_pb2_grpc)

API_KEYS = {"acme": "llmmesh-demo-acme", "globex": "llmmesh-demo-globex"}
_CLASSES = {"interactive": common_pb2.REQUEST_CLASS_INTERACTIVE,
            "batch": common_pb2.REQUEST_CLASS_BATCH}
Event = int | dict


class TargetError(Exception):
    """A request failed in a way the target names (an HTTP status, a gRPC code)."""


def _usage(u: common_pb2.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "cached_prompt_tokens": u.cached_prompt_tokens,
            "completion_tokens": u.completion_tokens, "queue_s": u.queue_seconds,
            "prefill_device_s": u.prefill_device_seconds,
            "decode_device_s": u.decode_device_seconds}


def _sampling(spec: RequestSpec) -> common_pb2.SamplingParams:
    # Greedy everywhere, so every target decodes the same continuation of the same tokens.
    return common_pb2.SamplingParams(max_tokens=spec.max_tokens, temperature=0.0)


class WorkerLoads:
    """Sums GetLoad over workers: KV usage is used blocks / all blocks (cached-idle counts free)."""

    def __init__(self, addresses: list[str], identity: MeshIdentity) -> None:
        self.channels = [mtls.aio_channel(a, identity, Role.WORKER) for a in addresses]
        self.stubs = [worker_pb2_grpc.WorkerServiceStub(c) for c in self.channels]
        self.device_type, self.quantization = "cpu", ""

    async def sample(self) -> dict | None:
        try:
            loads = await asyncio.gather(*(s.GetLoad(worker_pb2.GetLoadRequest(), timeout=2)
                                           for s in self.stubs))
        except grpc.aio.AioRpcError:
            return None
        total = sum(x.num_total_blocks for x in loads) or 1
        self.device_type = loads[0].device_type or self.device_type
        self.quantization = loads[0].quantization
        return {"kv_usage": 1 - sum(x.num_free_blocks for x in loads) / total,
                "running": sum(x.num_running for x in loads),
                "waiting": sum(x.num_waiting for x in loads)}

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.channels))


async def _close(loads: WorkerLoads | None, channel) -> None:
    """Closes what start() got to open (it may have failed half-way)."""
    if loads is not None:
        await loads.close()
    if channel is not None:
        await channel.close()


class MeshTarget:
    """The whole mesh, started privately (or an external one: gateway/costd addresses given)."""

    name = "mesh"

    def __init__(self, var_dir: str, num_workers: int = 1, worker_args: list[str] | None = None,
                 gateway: str = "", costd: str = "", worker_addresses: list[str] | None = None):
        self.mesh = None if gateway else Mesh(var_dir=var_dir, redis_url=None,
                                              worker_args=list(worker_args or []))
        self.num_workers, self.gateway, self.costd = num_workers, gateway, costd
        self.worker_addresses = list(worker_addresses or [])
        self.loads: WorkerLoads | None = None
        self.channel = None

    async def start(self) -> None:
        if self.mesh is not None:
            try:
                await self.mesh.up(num_workers=self.num_workers)
            except BaseException:
                self.mesh.down()   # a service that never came up leaves none of them running
                raise
            self.gateway = self.mesh.procs["gateway"].address
            self.costd = self.mesh.procs["costd"].address
            self.worker_addresses = [p.address for n, p in self.mesh.procs.items()
                                     if n.startswith("worker")]
        self.channel = grpc.aio.insecure_channel(self.gateway)
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)
        self.loads = (WorkerLoads(self.worker_addresses, self.identity(Role.ADMIN))
                      if self.worker_addresses else None)

    def identity(self, role: Role) -> MeshIdentity:
        return self.mesh.identity(role) if self.mesh else MeshIdentity.from_env(role)

    async def stream(self, spec: RequestSpec) -> AsyncIterator[Event]:
        req = gateway_pb2.GenerateRequest(sampling=_sampling(spec),
                                          request_class=_CLASSES[spec.request_class])
        for role, content in spec.messages:
            req.messages.add(role=role, content=content)
        metadata = (("authorization", f"Bearer {API_KEYS[spec.tenant]}"),)
        try:
            async for msg in self.stub.Generate(req, metadata=metadata):
                if msg.HasField("chunk"):
                    yield len(msg.chunk.token_ids)
                else:
                    yield _usage(msg.final.usage)
        except grpc.aio.AioRpcError as exc:
            raise TargetError(exc.code().name) from exc

    async def load(self) -> dict | None:
        return await self.loads.sample() if self.loads else None

    async def bill(self, start_unix_s: float, end_unix_s: float, num_requests: int) -> dict | None:
        return await costd_bill(self.costd, self.identity(Role.ADMIN), start_unix_s, end_unix_s,
                                num_requests)

    def describe(self) -> str:
        if self.mesh is None:
            return f"llmmesh mesh (external, gateway {self.gateway}, costd {self.costd})"
        return f"llmmesh mesh (private): gateway → Redis → router → {self.num_workers} worker(s)"

    async def stop(self) -> None:
        await _close(self.loads, getattr(self, "channel", None))
        if self.mesh is not None:
            await asyncio.to_thread(self.mesh.down)


async def _sse_events(resp: httpx.Response) -> AsyncIterator[dict]:
    """The JSON events of an OpenAI-style server-sent-events stream, up to [DONE]."""
    if resp.status_code != 200:
        raise TargetError(f"HTTP_{resp.status_code}")
    async for line in resp.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


class HttpMeshTarget:
    """The same mesh through the gateway's OpenAI-compatible HTTP front (SSE), attached to a
    MeshTarget's gateway: bench.overhead pairs it with the gRPC front request by request."""

    name = "mesh-http"

    def __init__(self, http_address: str):
        self.base = f"http://{http_address}/v1"

    async def start(self) -> None:
        self.client = httpx.AsyncClient(base_url=self.base, timeout=httpx.Timeout(None),
                                        limits=httpx.Limits(max_keepalive_connections=8))

    async def stream(self, spec: RequestSpec) -> AsyncIterator[Event]:
        body = {"model": DEFAULT_MODEL, "max_tokens": spec.max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": r, "content": c} for r, c in spec.messages]}
        headers = {"authorization": f"Bearer {API_KEYS[spec.tenant]}"}
        if spec.request_class == "batch":
            body["service_tier"] = "flex"
        async with self.client.stream("POST", "/chat/completions", json=body, headers=headers) as resp:
            async for event in _sse_events(resp):
                if event.get("usage"):
                    u = event["usage"]
                    # The mesh's request id (the ledger's key): device times are read from there.
                    yield {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
                           "cached_prompt_tokens": u["prompt_tokens_details"]["cached_tokens"],
                           "request_id": resp.headers.get("x-request-id", "")}
                elif event["choices"] and event["choices"][0]["delta"].get("content"):
                    yield 1   # interactive: one token per chunk

    async def load(self) -> dict | None:
        return None

    async def bill(self, start_unix_s: float, end_unix_s: float, num_requests: int) -> dict | None:
        return None

    def describe(self) -> str:
        return f"llmmesh mesh through its OpenAI-compatible HTTP front ({self.base})"

    async def stop(self) -> None:
        if hasattr(self, "client"):
            await self.client.aclose()


class WorkerTarget:
    """One worker process alone (Redis only for its lease; costd only receives its spans)."""

    name = "worker"

    def __init__(self, var_dir: str, worker_args: list[str] | None = None,
                 attach_address: str = "", tls_dir: str | None = None):
        # attach_address: call a worker someone else started (bench.overhead pairs the mesh's
        # own worker with the mesh), with that mesh's certificates (tls_dir); nothing is started
        # or stopped here then.
        self.attach_address, self.tls_dir = attach_address, tls_dir
        self.mesh = None if attach_address else Mesh(var_dir=var_dir,
                                                     worker_args=list(worker_args or []))

    async def start(self) -> None:
        address = self.attach_address
        if not address:
            self.mesh.start_redis()
            self.mesh.start_service("costd", "costd")
            await self.mesh.wait_ready(["costd"])
            address = self.mesh.start_worker("worker0").address
            await self.mesh.wait_ready(["worker0"], timeout_s=180)
        # Called as a router would: the same mutual TLS hop the mesh's router pays for.
        router = self.mesh.identity(Role.ROUTER) if self.mesh else MeshIdentity.from_env(
            Role.ROUTER, self.tls_dir)
        self.channel = mtls.aio_channel(address, router, Role.WORKER)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.loads = WorkerLoads([address], router)

    async def stream(self, spec: RequestSpec) -> AsyncIterator[Event]:
        # The cache salt the gateway would give a demo tenant (its cache scope is its id).
        req = worker_pb2.WorkerGenerateRequest(
            request_id=uuid.uuid4().hex, tenant_id=spec.tenant, model=DEFAULT_MODEL,
            prompt_token_ids=spec.prompt_token_ids, sampling=_sampling(spec),
            request_class=_CLASSES[spec.request_class], cache_salt=f"scope:{spec.tenant}",
            num_original_prompt_tokens=len(spec.prompt_token_ids))
        try:
            async for msg in self.stub.Generate(req):
                if msg.HasField("tokens"):
                    yield len(msg.tokens.token_ids)
                else:
                    yield _usage(msg.final.usage)
        except grpc.aio.AioRpcError as exc:
            raise TargetError(exc.code().name) from exc

    async def load(self) -> dict | None:
        return await self.loads.sample()

    async def bill(self, start_unix_s: float, end_unix_s: float, num_requests: int) -> dict | None:
        return None  # no router, so no billing span: priced from device seconds instead

    def describe(self) -> str:
        return "llmmesh worker called directly over gRPC (no gateway, Redis queue or router)"

    async def stop(self) -> None:
        await _close(getattr(self, "loads", None), getattr(self, "channel", None))
        if self.mesh is not None:
            await asyncio.to_thread(self.mesh.down)


class LlamaCppTarget:
    """llama-server on the same GGUF, fed the same token ids over its OpenAI-compatible API."""

    name = "llamacpp"

    def __init__(self, var_dir: str, parallel: int = 32, threads: int = 0):
        os.makedirs(var_dir, exist_ok=True)
        self.server = LlamaServer(resolve_model().gguf_path, free_port(), parallel=parallel,
                                  threads=threads,
                                  log_path=os.path.join(var_dir, "llama-server.log"))
        self.build: ServerBuild | None = None

    async def start(self) -> None:
        s = self.server
        self.build = await asyncio.to_thread(choose_server_build, s.gguf_path, s.threads)
        s.variant = self.build.variant
        await s.start()
        self.client = httpx.AsyncClient(base_url=self.server.url, timeout=httpx.Timeout(None),
                                        limits=httpx.Limits(max_connections=None,
                                                            max_keepalive_connections=None))

    async def stream(self, spec: RequestSpec) -> AsyncIterator[Event]:
        body = {"prompt": list(spec.prompt_token_ids), "max_tokens": spec.max_tokens,
                "temperature": 0.0, "stream": True, "cache_prompt": True}
        async with self.client.stream("POST", "/v1/completions", json=body) as resp:
            async for event in _sse_events(resp):
                if event.get("usage"):
                    yield _llama_usage(event["usage"])
                elif event.get("choices") and event["choices"][0].get("text"):
                    yield 1  # a partial may hold several tokens; TPOT uses the final count

    async def load(self) -> dict | None:
        try:
            values = parse_metrics((await self.client.get("/metrics")).text)
        except httpx.TransportError:
            return None
        return {"running": values.get("requests_processing", 0.0),
                "waiting": values.get("requests_deferred", 0.0)}

    async def bill(self, start_unix_s: float, end_unix_s: float, num_requests: int) -> dict | None:
        return None

    def describe(self) -> str:
        s = self.server
        return (f"llama.cpp llama-server (llama-cpp-python {llamacpp_version()} sdist), "
                f"--parallel {s.parallel}, -c {s.parallel * s.ctx_per_slot} "
                f"({s.ctx_per_slot} per slot), "
                + (f"-t {s.threads}" if s.threads else "threads: llama.cpp's default")
                + ", continuous batching"
                + (f"; build: {self.build.variant} ({self.build.reason})" if self.build else ""))

    async def stop(self) -> None:
        if hasattr(self, "client"):
            await self.client.aclose()
        await asyncio.to_thread(self.server.stop)


def _llama_usage(u: dict) -> dict:
    return {"prompt_tokens": u.get("prompt_tokens", 0),
            "cached_prompt_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "completion_tokens": u.get("completion_tokens", 0)}
