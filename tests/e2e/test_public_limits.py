"""Limits on the public port, against the real gateway (a mesh with no worker, so every admitted
request waits in the queue: an idle stream). Oversize messages and metadata are refused at the
door; one tenant's open calls are capped on the gateway while another tenant's still open;
memory grows by a bounded amount per idle stream and comes back; a connection with no call is
closed after --idle-connection-s; a prompt too long for any context is refused without being
tokenized."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from llmmesh.launcher import Mesh
from llmmesh.v1 import gateway_pb2, gateway_pb2_grpc
from tests.e2e.meshkit import DEMO_KEYS, auth, chat

pytestmark = [pytest.mark.e2e, pytest.mark.model]
CAP = 440         # --max-streams-per-tenant for this test (default 256)
PER_TENANT = 500  # idle streams each of two tenants tries to open: 1,000 in all (S7)
IDLE_STREAM_S = 20  # --idle-stream-s: the gateway ends a call with no token for this long


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    m = Mesh(var_dir=str(tmp_path_factory.mktemp("limits")),
             gateway_args=["--max-streams-per-tenant", str(CAP), "--idle-connection-s", "1",
                           "--idle-stream-s", str(IDLE_STREAM_S),
                           "--max-message-mib", "1", "--max-streams", "1000"])
    try:
        asyncio.run(m.up(num_workers=0, timeout_s=120))
        yield m
    finally:
        m.down()


def rss_mib(mesh) -> float:
    with open(f"/proc/{mesh.procs['gateway'].popen.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_oversize_message_and_metadata_are_refused_at_the_door(mesh):
    with grpc.insecure_channel(mesh.procs["gateway"].address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        with pytest.raises(grpc.RpcError) as big:
            stub.Complete(gateway_pb2.CompleteRequest(request=chat("x" * (2 << 20), 4)),
                          metadata=auth(DEMO_KEYS["acme"]), timeout=10)
        assert big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as fat:
            stub.Complete(gateway_pb2.CompleteRequest(request=chat("hi", 4)),
                          metadata=(*auth(DEMO_KEYS["acme"]), ("x-padding", "p" * 64_000)),
                          timeout=10)
        assert fat.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
                                    grpc.StatusCode.UNAVAILABLE)
        # Under the message limit but longer than any context can hold: refused by size,
        # naming the field, before tokenizing (0.5 MiB of text would take ~0.3 s of the loop).
        started = time.perf_counter()
        with pytest.raises(grpc.RpcError) as long:
            stub.Complete(gateway_pb2.CompleteRequest(request=chat("word " * 100_000, 4)),
                          metadata=auth(DEMO_KEYS["acme"]), timeout=10)
        refused_s = time.perf_counter() - started
        assert long.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert long.value.details().startswith("messages:") and "cannot fit" in long.value.details()
        print(f"\n  500,000-character prompt refused in {refused_s * 1e3:.1f} ms")
        # The gateway is still there for a normal-sized call.
        models = stub.ListModels(gateway_pb2.ListModelsRequest(),
                                 metadata=auth(DEMO_KEYS["acme"]), timeout=10)
        assert models.models


def test_idle_streams_are_capped_per_tenant_and_their_memory_is_bounded(mesh):
    address = mesh.procs["gateway"].address

    async def run():
        before = rss_mib(mesh)
        # Several connections, as many clients would (a connection allows 100 streams; a local
        # subchannel pool keeps gRPC from sharing one connection among the channels).
        channels = [grpc.aio.insecure_channel(address, options=[
            ("grpc.use_local_subchannel_pool", 1)]) for _ in range(12)]
        calls, codes = [], {"acme": [], "globex": []}
        for i in range(PER_TENANT):
            for j, tenant in enumerate(("acme", "globex")):
                stub = gateway_pb2_grpc.GatewayServiceStub(channels[(2 * i + j) % len(channels)])
                calls.append((tenant, stub.Generate(chat(f"idle {tenant} {i}", 4),
                                                    metadata=auth(DEMO_KEYS[tenant]),
                                                    timeout=120)))

        async def first(tenant, call):
            try:
                async for _ in call:
                    return "data"
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        # Refusals come back at once; admitted streams stay open (nothing serves them).
        waits = [asyncio.create_task(first(t, c)) for t, c in calls]
        opened = time.monotonic()
        await asyncio.sleep(15)
        for (tenant, _), w in zip(calls, waits):
            codes[tenant].append(w.result() if w.done() else "open")
        during = rss_mib(mesh)
        # Nothing ever serves them, and their client deadline is far: the gateway's idle-stream
        # timeout ends every one of them, and cancels its request.
        ended = await asyncio.wait_for(asyncio.gather(*waits), IDLE_STREAM_S + 15)
        idle_ended = sum(1 for code in ended if code == grpc.StatusCode.DEADLINE_EXCEEDED)
        print(f"\n  {idle_ended} idle streams ended by --idle-stream-s {IDLE_STREAM_S} "
              f"(client deadline 120 s) {time.monotonic() - opened:.0f} s after they opened")
        assert idle_ended == 2 * CAP, (idle_ended, ended[:4])
        for channel in channels:
            await channel.close()
        await asyncio.sleep(2)
        return codes, before, during, rss_mib(mesh)

    codes, before, during, after = asyncio.run(run())
    for tenant in ("acme", "globex"):
        assert codes[tenant].count("open") == CAP, (tenant, codes[tenant][:5])
        assert codes[tenant].count(grpc.StatusCode.RESOURCE_EXHAUSTED) == PER_TENANT - CAP
    growth = during - before
    print(f"\n  gateway RSS {before:.0f} MiB -> {during:.0f} MiB with {2 * CAP} idle streams "
          f"(+{growth / (2 * CAP) * 1024:.0f} KiB each), {after:.0f} MiB after they closed")
    assert growth < 2 * CAP * 1.0   # under 1 MiB per idle stream
    # After they closed, a tenant may open streams again (the count came back to 0).
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Complete(gateway_pb2.CompleteRequest(request=chat("again", 4)),
                          metadata=auth(DEMO_KEYS["acme"]), timeout=1.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED   # admitted, then waited


def test_a_connection_with_no_call_is_closed_after_the_idle_timeout(mesh):
    with grpc.insecure_channel(mesh.procs["gateway"].address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        stub.ListModels(gateway_pb2.ListModelsRequest(), metadata=auth(DEMO_KEYS["acme"]),
                        timeout=10)
        states = []
        channel.subscribe(states.append, try_to_connect=False)
        deadline = time.monotonic() + 10
        while grpc.ChannelConnectivity.IDLE not in states[1:] and time.monotonic() < deadline:
            time.sleep(0.1)
        # READY after the call; the server's GOAWAY after 1 s idle sends the channel to IDLE.
        assert grpc.ChannelConnectivity.IDLE in states[1:], states
