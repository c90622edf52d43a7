"""`python -m bench.tls_hop`: what mutual TLS adds to one internal gRPC hop, measured in one run.

The same in-process grpc.aio server serves a plaintext port and a mutual-TLS port (the mesh's
own credentials, llmmesh.mtls); a client alternates calls between them on warm channels (the
mesh keeps its channels open, so handshakes are not on a request's path) and reports the
median of the per-pair differences, for a unary call and for a 32-message server stream (the
shape of a Generate call). Writes bench/results/tls-hop.md with the command and commit.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmmesh import certs, mtls
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity

RESULTS = Path(__file__).resolve().parent / "results" / "tls-hop.md"


class Streamer(health.aio.HealthServicer):
    async def Watch(self, request, context):   # 32 messages: a Generate-sized stream
        for _ in range(32):
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def _time(stub, streaming: bool) -> float:
    start = time.perf_counter()
    if streaming:
        async for _ in stub.Watch(health_pb2.HealthCheckRequest()):
            pass
    else:
        await stub.Check(health_pb2.HealthCheckRequest())
    return time.perf_counter() - start


async def measure(pairs: int) -> dict:
    directory = tempfile.mkdtemp(prefix="llmmesh-tls-bench-")
    certs.ensure(directory, roles=[Role.WORKER, Role.ROUTER])
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(Streamer(), server)
    plain = server.add_insecure_port("127.0.0.1:0")
    secure = server.add_secure_port("127.0.0.1:0", mtls.server_credentials(
        MeshIdentity(Path(directory), Role.WORKER)))
    await server.start()
    plain_ch = grpc.aio.insecure_channel(f"127.0.0.1:{plain}")
    tls_ch = mtls.aio_channel(f"127.0.0.1:{secure}", MeshIdentity(Path(directory), Role.ROUTER), Role.WORKER)
    stubs = {"plain": health_pb2_grpc.HealthStub(plain_ch), "tls": health_pb2_grpc.HealthStub(tls_ch)}
    out = {}
    try:
        for streaming in (False, True):
            for stub in stubs.values():          # warm: connect and handshake before timing
                for _ in range(50):
                    await _time(stub, streaming)
            diffs, plain_s, tls_s = [], [], []
            for i in range(pairs):
                order = ("plain", "tls") if i % 2 else ("tls", "plain")
                got = {name: await _time(stubs[name], streaming) for name in order}
                plain_s.append(got["plain"])
                tls_s.append(got["tls"])
                diffs.append(got["tls"] - got["plain"])
            out["stream of 32" if streaming else "unary"] = {
                "plain_us": statistics.median(plain_s) * 1e6, "tls_us": statistics.median(tls_s) * 1e6,
                "added_us": statistics.median(diffs) * 1e6}
    finally:
        await plain_ch.close()
        await tls_ch.close()
        await server.stop(0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tls_hop")
    parser.add_argument("--pairs", type=int, default=2000)
    args = parser.parse_args()
    result = asyncio.run(measure(args.pairs))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    lines = ["# What mutual TLS adds to one internal hop", "",
             f"- command: `python -m bench.tls_hop --pairs {args.pairs}`",
             f"- commit: {commit}; machine: {cpu}, one process (client and server on one event loop)",
             "- warm channels (the mesh reuses its channels: no handshake on a request's path); "
             "plaintext and mTLS calls alternate, the added time is the median of the pairs' differences",
             "", "| call | plaintext p50 (µs) | mTLS p50 (µs) | added, median of pairs (µs) |",
             "|---|---|---|---|"]
    for name, r in result.items():
        lines.append(f"| {name} | {r['plain_us']:.0f} | {r['tls_us']:.0f} | {r['added_us']:+.0f} |")
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
