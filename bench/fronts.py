"""What the HTTP front adds over the gRPC front, with the engine taken out of the reading.

Through the whole mesh, a request's TTFT moves by ±10 ms from one request to the next with the
prefill on a shared 2-core host, and its time per token with the engine's steps; a 1 ms or
0.1 ms difference between two fronts drowns in that. Here the real gateway (both doors, the same
process), a real Redis and costd run, and this process plays router and worker: it reads each
queue entry and writes the result stream in the workers' format, one token every `pace`, noting
when it wrote each token. The client (same process, same clock) notes when each token arrives.
So the readings are exactly the fronts' share:

- TTFT: request sent → first token received (parse, tokenize, admission script, enqueue, the
  result stream's XREAD wake-up, relay, framing), the fake engine answering at once;
- delivery latency per token: token written to Redis → token received by the client.

Requests alternate between the doors in a random order per round (paired differences), greedy
shapes like bench.overhead's. `python -m bench.fronts` prints its table; bench.overhead runs it
in the same invocation and adds it to overhead-paired.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid

import grpc
import httpx
import redis.asyncio as aioredis

from llmmesh import queue, streamauth
from llmmesh.launcher import Mesh
from llmmesh.models import DEFAULT_MODEL, resolve_model
from llmmesh.tokenizer import Tokenizer
from llmmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

KEY = "llmmesh-demo-acme"
PROMPT = ("Summarise the following note in one sentence. The quarterly review found that the "
          "warehouse in the north ran at full capacity for most of the period, while the one "
          "in the south stayed half empty; moving stock between them took two days on average.")


class FakeEngine:
    """Router and worker in one: answers every queued request from its result stream."""

    def __init__(self, redis: aioredis.Redis, token_id: int, tokens: int, pace_s: float):
        self.redis, self.token_id, self.tokens, self.pace_s = redis, token_id, tokens, pace_s
        self.written: dict[str, list[float]] = {}    # client request id -> write times

    async def run(self) -> None:
        stream = queue.queue_stream("interactive")
        try:
            await self.redis.xgroup_create(stream, queue.ROUTER_GROUP, id="0", mkstream=True)
        except aioredis.ResponseError:
            pass
        while True:
            reply = await self.redis.xreadgroup(queue.ROUTER_GROUP, "fake", {stream: ">"},
                                                count=16, block=1000)
            for _, entries in reply or ():
                for entry_id, fields in entries:
                    entry = queue.QueueEntry.decode(fields)
                    asyncio.ensure_future(self._answer(stream, entry_id, entry))

    async def _answer(self, stream: str, entry_id: str, entry: queue.QueueEntry) -> None:
        client_id = entry.request_id.split("/")[1]
        times = self.written.setdefault(client_id, [])
        results = queue.result_stream(entry.request_id)
        # Signed as a router and its worker sign (llmmesh.streamauth), or the gateway drops it.
        attempt = streamauth.attempt_number(1, 0)
        key = streamauth.attempt_key(entry.stream_key, attempt) if entry.stream_key else None
        for i in range(self.tokens):
            if i:
                await asyncio.sleep(self.pace_s)
            times.append(time.perf_counter())
            await queue.append_tokens(self.redis, results, i, [self.token_id], attempt=attempt,
                                      key=key)
        usage = {"prompt_tokens": len(entry.prompt_token_ids), "cached_prompt_tokens": 0,
                 "completion_tokens": self.tokens}
        await self.redis.xadd(results, queue.final_event(
            "length", usage, streamauth.router_key(entry.stream_key) if entry.stream_key else None))
        await self.redis.expire(results, 60)
        await self.redis.xack(stream, queue.ROUTER_GROUP, entry_id)


async def _grpc(stub, rid: str, tokens: int) -> tuple[float, list[float]]:
    req = gateway_pb2.GenerateRequest(request_id=rid, sampling=common_pb2.SamplingParams(
        max_tokens=tokens, temperature=0.0), request_class=common_pb2.REQUEST_CLASS_INTERACTIVE)
    req.messages.add(role="user", content=PROMPT)
    sent, got = time.perf_counter(), []
    async for msg in stub.Generate(req, metadata=(("authorization", f"Bearer {KEY}"),)):
        if msg.HasField("chunk") and msg.chunk.token_ids:
            got.append(time.perf_counter())
    return sent, got


async def _http(client: httpx.AsyncClient, rid: str, tokens: int) -> tuple[float, list[float]]:
    body = {"model": DEFAULT_MODEL, "max_tokens": tokens, "temperature": 0.0, "stream": True,
            "messages": [{"role": "user", "content": PROMPT}]}
    headers = {"authorization": f"Bearer {KEY}", "x-client-request-id": rid}
    sent, got = time.perf_counter(), []
    async with client.stream("POST", "/chat/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200, resp.status_code
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"role"' not in line:
                got.append(time.perf_counter())
    return sent, got


class RawHttp:
    """A minimal HTTP/1.1 keep-alive client (chunked SSE): the client's own cost kept as small
    as grpc.aio's C core keeps the gRPC side's, so the difference is the server's."""

    def __init__(self, address: str):
        self.host, _, port = address.rpartition(":")
        self.port = int(port)
        self.reader = self.writer = None

    async def call(self, rid: str, tokens: int) -> tuple[float, list[float]]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        body = json.dumps({"model": DEFAULT_MODEL, "max_tokens": tokens, "temperature": 0.0,
                           "stream": True,
                           "messages": [{"role": "user", "content": PROMPT}]}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {self.host}\r\n"
                f"authorization: Bearer {KEY}\r\ncontent-type: application/json\r\n"
                f"x-client-request-id: {rid}\r\ncontent-length: {len(body)}\r\n\r\n").encode()
        sent, got = time.perf_counter(), []
        self.writer.write(head + body)
        status = await self.reader.readline()
        assert b" 200 " in status, status
        while (await self.reader.readline()) != b"\r\n":
            pass
        while True:
            size = int((await self.reader.readline()).strip(), 16)
            if size == 0:
                await self.reader.readline()
                return sent, got
            data = await self.reader.readexactly(size + 2)
            for frame in data.split(b"\n\n"):
                if frame.startswith(b"data: {") and b'"content":"' in frame and b'"role"' not in frame:
                    got.append(time.perf_counter())

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _reading(sent: float, got: list[float], written: list[float]) -> dict:
    assert len(got) == len(written), (len(got), len(written))
    return {"ttft_s": got[0] - sent,
            "delivery_s": statistics.fmean(g - w for g, w in zip(got, written))}


async def measure(rounds: int = 200, tokens: int = 32, pace_s: float = 0.005, seed: int = 7,
                  var_dir: str = "var/bench-fronts") -> dict:
    mesh = Mesh(var_dir=var_dir)
    token_id = Tokenizer.from_gguf(resolve_model().gguf_path).encode(" the")[0]
    try:
        mesh.start_redis()
        mesh.start_service("costd", "costd")
        await mesh.wait_ready(["costd"])
        mesh.start_service("gateway", "gateway")
        # The same gateway with its metrics off: what recording them costs a request.
        mesh.start_service("gateway-nometrics", "gateway", ["--metrics-port", "-1"])
        await mesh.wait_ready(["gateway", "gateway-nometrics"])
        redis = aioredis.Redis.from_url(mesh.redis_url, decode_responses=True)
        engine = FakeEngine(redis, token_id, tokens, pace_s)
        engine_task = asyncio.ensure_future(engine.run())
        channel = grpc.aio.insecure_channel(mesh.procs["gateway"].address)
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        bare_channel = grpc.aio.insecure_channel(mesh.procs["gateway-nometrics"].address)
        bare = gateway_pb2_grpc.GatewayServiceStub(bare_channel)
        client = httpx.AsyncClient(base_url=mesh.openai_base_url, timeout=httpx.Timeout(30.0))
        raw = RawHttp(mesh.procs["gateway"].http_address)
        rng, rows, nonce = random.Random(seed), [], uuid.uuid4().hex[:8]
        try:
            for i in range(-10, rounds):          # the first 10 rounds warm every door
                order = [("grpc", lambda r: _grpc(stub, r, tokens)),
                         ("http", lambda r: raw.call(r, tokens)),
                         ("httpx", lambda r: _http(client, r, tokens)),
                         ("grpc_nometrics", lambda r: _grpc(bare, r, tokens))]
                rng.shuffle(order)
                row = {}
                for name, call in order:
                    rid = f"{name}-{nonce}-{i + 10}"
                    sent, got = await call(rid)
                    row[name] = _reading(sent, got, engine.written.pop(rid))
                if i >= 0:
                    rows.append(row)
        finally:
            engine_task.cancel()
            await asyncio.gather(engine_task, return_exceptions=True)
            await raw.close()
            await client.aclose()
            await channel.close()
            await bare_channel.close()
            await redis.aclose()
    finally:
        await asyncio.to_thread(mesh.down)
    return {"rows": rows, "summary": summarise(rows), "httpx_summary": summarise(rows, "httpx"),
            "metrics_summary": summarise(rows, "grpc", "grpc_nometrics"),
            "tokens": tokens, "pace_s": pace_s}


def summarise(rows: list[dict], http: str = "http", base: str = "grpc") -> dict:
    out = {}
    for metric in ("ttft_s", "delivery_s"):
        diffs = [r[http][metric] - r[base][metric] for r in rows if http in r and base in r]
        q = statistics.quantiles(diffs, n=4)
        # "http" / "grpc": the door measured and the door it is compared with.
        out[metric] = {"http_p50": statistics.median(r[http][metric] for r in rows if http in r),
                       "grpc_p50": statistics.median(r[base][metric] for r in rows if base in r),
                       "added_p50": statistics.median(diffs), "added_q1": q[0], "added_q3": q[2],
                       "n": len(diffs)}
    return out


TARGET_TTFT_MS, TARGET_PER_TOKEN_MS = 1.0, 0.1


def report_lines(result: dict) -> list[str]:
    s = result["summary"]
    lines = [f"{s['ttft_s']['n']} rounds; each round sends one request through each door in "
             f"random order: gRPC (grpc.aio), HTTP with a minimal keep-alive client (judged: the "
             f"server's share), HTTP with httpx (what a Python httpx user sees). "
             f"{result['tokens']} tokens each, written {result['pace_s'] * 1e3:g} ms apart by "
             "the fake engine. Issue 17 target: ≤ 1 ms added p50 TTFT, ≤ 0.1 ms added per token.",
             "", "| metric | client | HTTP p50 (ms) | gRPC p50 (ms) | added, median of rounds (ms) | "
             "q1 – q3 (ms) | target |", "|---|---|---|---|---|---|---|"]
    for metric, name, limit in (("ttft_s", "TTFT (engine answering at once)", TARGET_TTFT_MS),
                                ("delivery_s", "per token: written to Redis → at the client",
                                 TARGET_PER_TOKEN_MS)):
        for key, client in (("summary", "minimal"), ("httpx_summary", "httpx")):
            m = result[key][metric]
            added = m["added_p50"] * 1e3
            verdict = f"≤ {limit:g} {'✅' if added <= limit else '❌'}" if key == "summary" else "(context)"
            lines.append(f"| {name} | {client} | {m['http_p50'] * 1e3:.3f} | {m['grpc_p50'] * 1e3:.3f} | "
                         f"{added:+.3f} | {m['added_q1'] * 1e3:+.3f} – {m['added_q3'] * 1e3:+.3f} | "
                         f"{verdict} |")
    m = result.get("metrics_summary")
    if m:
        lines += ["", "What recording metrics costs (issue 15: ≤ 0.5 ms added p50 TTFT): the same "
                  "rounds also go to a second gateway started with `--metrics-port -1`; gRPC both.",
                  "", "| metric | metrics on p50 (ms) | metrics off p50 (ms) | added, median of "
                  "rounds (ms) | q1 – q3 (ms) | target |", "|---|---|---|---|---|---|"]
        for metric, name, limit in (("ttft_s", "TTFT", 0.5),
                                    ("delivery_s", "per token: written → at the client", None)):
            x = m[metric]
            added = x["added_p50"] * 1e3
            verdict = "(context)" if limit is None else f"≤ {limit:g} {'✅' if added <= limit else '❌'}"
            lines.append(f"| {name} | {x['http_p50'] * 1e3:.3f} | {x['grpc_p50'] * 1e3:.3f} | "
                         f"{added:+.3f} | {x['added_q1'] * 1e3:+.3f} – {x['added_q3'] * 1e3:+.3f} | "
                         f"{verdict} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.fronts")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--pace-ms", type=float, default=5.0)
    args = p.parse_args()
    result = asyncio.run(measure(args.rounds, args.tokens, args.pace_ms / 1e3))
    print("\n".join(report_lines(result)))



if __name__ == "__main__":
    main()
