"""Helpers shared by the end-to-end tests: clients, streams, waiting on conditions."""
from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from llmmesh import mtls
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity
from llmmesh.v1 import common_pb2, gateway_pb2, worker_pb2, worker_pb2_grpc

DEMO_KEYS = {"acme": "llmmesh-demo-acme", "globex": "llmmesh-demo-globex"}

TENANTS_TOML = """
[tenants.acme]
api_key_sha256 = ["c71f7b3a34c93b013e0d436f185a7c6ae7d96310503009de4a7629969ad757b2"]
cache_scope = "acme"

[tenants.globex]
api_key_sha256 = ["c54742215aa3e77fdfd0dce776edd19d733ea672aaa10e106c30376e21ea4681"]
cache_scope = "globex"

[tenants.capped]
# key: llmmesh-test-capped
api_key_sha256 = ["{capped}"]
token_budget = {budget}
budget_period = "day"
"""


def tenants_file(path, budget: int) -> str:
    import hashlib
    digest = hashlib.sha256(b"llmmesh-test-capped").hexdigest()
    with open(path, "w") as f:
        f.write(TENANTS_TOML.format(capped=digest, budget=budget))
    return str(path)


@contextlib.contextmanager
def mesh_with_tenants(var, tenants_toml: str):
    """A mesh of its own (one worker, one router) whose gateway reads `tenants_toml`; stopped on
    exit. For modules whose tenants differ from the demo ones."""
    from llmmesh.launcher import Mesh
    (var / "tenants.toml").write_text(tenants_toml)
    m = Mesh(var_dir=str(var), worker_args=["--max-num-seqs", "8"],
             gateway_args=["--tenants", str(var / "tenants.toml")])
    try:
        asyncio.run(m.up(num_workers=1, timeout_s=240))
        yield m
    finally:
        m.down()


def auth(key: str):
    return (("authorization", f"Bearer {key}"),)


def chat(text: str, max_tokens: int = 30, batch: bool = False) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
        request_class=common_pb2.REQUEST_CLASS_BATCH if batch else common_pb2.REQUEST_CLASS_INTERACTIVE)
    req.messages.add(role="user", content=text)
    return req


def worker_load(address: str) -> worker_pb2.GetLoadResponse:
    with mtls.channel(address, MeshIdentity.from_env(Role.ADMIN), Role.WORKER) as channel:
        return worker_pb2_grpc.WorkerServiceStub(channel).GetLoad(worker_pb2.GetLoadRequest(), timeout=2)


def ledger_rows(mesh, request_id: str, columns: str) -> list[tuple]:
    """`columns` of the costd ledger rows whose id is `request_id`, or a mesh id made from it
    (tenant/request_id/nonce)."""
    import sqlite3
    conn = sqlite3.connect(f"{mesh.var_dir}/ledger.sqlite")
    try:
        return conn.execute(f"SELECT {columns} FROM usage_records WHERE request_id = ? "
                            "OR request_id LIKE ?", (request_id, f"%/{request_id}/%")).fetchall()
    finally:
        conn.close()


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


class StreamRecorder:
    """Consumes one Generate stream in a thread, keeping every chunk and the outcome."""

    def __init__(self, stub, req, key: str, timeout_s: float = 180):
        import threading
        self.chunks: list[gateway_pb2.TokenChunk] = []
        self.final = None
        self.error: grpc.RpcError | None = None
        self.call = stub.Generate(req, metadata=auth(key), timeout=timeout_s)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for msg in self.call:
                if msg.HasField("chunk"):
                    self.chunks.append(msg.chunk)
                else:
                    self.final = msg.final
        except grpc.RpcError as exc:
            self.error = exc

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    def assert_contiguous(self) -> None:
        expected = 0
        for c in self.chunks:
            if c.token_ids:
                assert c.index == expected, f"chunk index {c.index}, expected {expected}"
                expected += len(c.token_ids)
