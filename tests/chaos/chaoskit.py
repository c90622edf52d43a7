"""What every chaos scenario shares: clients that record what they got, and the report that
holds those records against the costd ledger.

A client record is one request as its client saw it: the tokens that reached it, and how it
ended (a final with usage, a typed gRPC error, or neither: lost). Each request carries a client
id `<tag>-<i>`, so a scenario's ledger rows are found by id (the ledger's request id is
`tenant/<client id>/<nonce>`) even when several scenarios share one mesh. The report prints

    sent / completed / typed errors / lost / double-billed / unbilled tokens

and asserts what the issue asks of every scenario: lost = 0, double-billed = 0, unbilled
delivered tokens = 0, and the ledger's tokens per tenant equal to what the clients observed
(completion tokens of every request; prompt tokens of the completed ones: a client that got an
error is never told its prompt's size). A row goes to $LLMMESH_CHAOS_REPORT under `make chaos`.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from llmmesh import mtls
from llmmesh.identity import Role
from llmmesh.mtls import MeshIdentity
from llmmesh.v1 import gateway_pb2_grpc
from tests.e2e.meshkit import DEMO_KEYS, auth, chat, wait_until

SCALE = int(os.environ.get("LLMMESH_CHAOS_SCALE", "1"))   # make chaos: 5
TENANTS = ("acme", "globex")
# Routers that take a stopped one's entries over within seconds (the default waits 15 s).
ROUTER_ARGS = ["--claim-idle-ms", "2000", "--heartbeat-s", "0.5"]
TINY = "tiny-llama"
STEP_DELAY_ENV = "LLMMESH_TEST_STEP_DELAY_MS"   # workers/__main__.py: every forward pass slower


def tiny_catalog(var: Path, seed: int, kv_cache_mib: int) -> str:
    """A models file serving only a Llama GGUF generated here (tests/tiny_gguf.py: 2 layers, 64
    wide), for scenarios about the mesh, not the model; returns its path."""
    from tests.tiny_gguf import write_tiny_llama
    tiny = write_tiny_llama(str(var / "tiny.gguf"), hidden=64, layers=2, seed=seed)
    catalog = var / "models.toml"
    catalog.write_text(f'default = "{TINY}"\n[models.{TINY}]\nsource = "{tiny}"\n'
                       f'quantization = "fp32"\nkv_cache_mib = {kv_cache_mib}\npinned = true\n')
    return str(catalog)


@dataclass
class GcPauses:
    """This (client) process's garbage-collection pauses while it records: a collection stops
    every client thread, so a deadline the client measures ends late by as much (make chaos,
    F2: a 116 ms pause and the client's overshoot p99 81.5 ms, while the router wrote its error
    events p99 43 ms after the deadline)."""

    count: int = 0
    longest_s: float = 0.0
    _started: float = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count += 1
            self.longest_s = max(self.longest_s, time.perf_counter() - self._started)


@dataclass
class Stalls:
    """How late this (client) process's threads woke while it recorded: a thread that sleeps
    1 ms again and again notes each oversleep. On a shared 2-core host the hypervisor and the
    mesh's own processes delay the client, and a deadline the client measures ends late by as
    much; the mesh is not the cause (make test, F2 on a loaded Zen 3: the client's overshoot p99
    71.6 ms while the router wrote half its error events before the deadline)."""

    longest_s: float = 0.0
    over_10ms: int = 0
    steal_s: float = 0.0       # the VM's CPU time taken by the hypervisor (/proc/stat steal)


def _steal_s() -> float:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


@contextlib.contextmanager
def client_stalls():
    import threading
    stalls, stop = Stalls(), threading.Event()

    def probe() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            time.sleep(0.001)
            late = time.perf_counter() - started - 0.001
            stalls.longest_s = max(stalls.longest_s, late)
            stalls.over_10ms += late > 0.010

    steal = _steal_s()
    thread = threading.Thread(target=probe, name="stall-probe", daemon=True)
    thread.start()
    try:
        yield stalls
    finally:
        stop.set()
        thread.join()
        stalls.steal_s = _steal_s() - steal


@contextlib.contextmanager
def gc_pauses():
    """Records the pauses, after moving every object the suite has made so far out of the
    collector's sight (gc.freeze): a full collection then walks only what the scenario makes,
    not the records of every scenario before it, so it stays short."""
    pauses = GcPauses()
    gc.collect()
    gc.freeze()
    gc.callbacks.append(pauses)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(pauses)
        gc.unfreeze()


@contextlib.contextmanager
def chaos_mesh(var, *, workers: int, routers: int = 2, gateways: int = 1,
               worker_args: list[str] | None = None, gateway_args: list[str] | None = None,
               router_args: list[str] = ROUTER_ARGS, env: dict[str, str] | None = None):
    """A mesh up for a scenario (extra environment for every service), down afterwards."""
    from llmmesh.launcher import Mesh
    m = Mesh(var_dir=str(var), worker_args=list(worker_args or ["--max-num-seqs", "8"]),
             gateway_args=list(gateway_args or []), router_args=list(router_args))
    m.env.update(env or {})
    try:
        asyncio.run(m.up(num_workers=workers, num_routers=routers, timeout_s=240))
        for i in range(1, gateways):
            m.start_service(f"gateway{i}", "gateway", m.gateway_args)
            asyncio.run(m.wait_ready([f"gateway{i}"], 120))
        yield m
    finally:
        m.down()


@dataclass
class Outcome:
    """One request as its client saw it."""

    tenant: str
    client_id: str
    num_tokens: int = 0                 # completion tokens that reached the client
    usage: object | None = None         # the final's usage when it completed
    code: grpc.StatusCode | None = None  # the typed error it ended in, if any
    started: float = 0.0                # time.monotonic() at the call
    seconds: float = 0.0                # call to its end
    max_gap_s: float = 0.0              # longest wait between two messages (after the first)
    chunk_times: list[float] = field(default_factory=list, repr=False)

    @property
    def lost(self) -> bool:
        return self.usage is None and self.code is None


def generate(gateway: str, tenant: str, client_id: str, prompt: str, max_tokens: int,
             timeout_s: float) -> Outcome:
    """One streamed Generate call, recorded."""
    out = Outcome(tenant, client_id, started=time.monotonic())
    req = chat(prompt, max_tokens)
    req.request_id = client_id
    last = None
    try:
        with grpc.insecure_channel(gateway) as channel:
            stub = gateway_pb2_grpc.GatewayServiceStub(channel)
            for msg in stub.Generate(req, metadata=auth(DEMO_KEYS[tenant]), timeout=timeout_s):
                now = time.monotonic()
                if last is not None:
                    out.max_gap_s = max(out.max_gap_s, now - last)
                last = now
                out.chunk_times.append(now)
                if msg.HasField("chunk"):
                    out.num_tokens += len(msg.chunk.token_ids)
                else:
                    out.usage = msg.final.usage
    except grpc.RpcError as exc:
        out.code = exc.code()
    except Exception:  # noqa: BLE001 - neither an answer nor a typed error: lost
        pass
    out.seconds = time.monotonic() - out.started
    return out


# A prompt the model answers at length, so a request runs until max_tokens: "Name a color"
# is answered in 2-3 tokens, and on a fast CPU such requests end before a scenario can act
# while they run (on a 2-core Zen 5 chaos Q1/Q2 never saw 3 of them running at once, and F7's
# faulty worker finished its share before the forward pass that raises).
LONG = "Write a long story about the color number {i}."


def send(mesh, n: int, tag: str, *, max_tokens: int = 6, concurrency: int = 8,
         timeout_s: float = 120, gateways: list[str] | None = None,
         interval_s: float = 0.0, prompt: str = "Name a color ({i}).") -> list[Outcome]:
    """n requests from two tenants, `concurrency` at a time, spread over the gateways (default:
    every gateway of the mesh); with `interval_s`, request i starts no earlier than i times it
    after the first (an open loop while concurrency allows). `prompt` is formatted with i."""
    gateways = gateways or gateway_addresses(mesh)
    start = time.monotonic()

    def one(i: int) -> Outcome:
        time.sleep(max(0.0, start + i * interval_s - time.monotonic()))
        return generate(gateways[i % len(gateways)], TENANTS[i % 2], f"{tag}-{i}",
                        prompt.format(i=i), max_tokens, timeout_s)
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(n)))


def gateway_addresses(mesh) -> list[str]:
    return [p.address for name, p in sorted(mesh.procs.items())
            if name.startswith("gateway") and p.alive()]


def ledger_rows(mesh, tag: str) -> dict[str, list[tuple[str, int, int]]]:
    """The scenario's ledger rows by client id: [(tenant, prompt tokens, completion tokens)]."""
    conn = sqlite3.connect(f"{mesh.var_dir}/ledger.sqlite")
    try:
        rows = conn.execute("SELECT request_id, tenant_id, prompt_tokens, completion_tokens "
                            "FROM usage_records").fetchall()
    except sqlite3.OperationalError:   # costd has not made its tables yet
        rows = []
    finally:
        conn.close()
    by_client: dict[str, list[tuple[str, int, int]]] = {}
    for request_id, tenant, prompt, completion in rows:
        parts = request_id.split("/")
        if len(parts) == 3 and parts[1].startswith(f"{tag}-"):
            by_client.setdefault(parts[1], []).append((tenant, prompt, completion))
    return by_client


@dataclass
class Tally:
    sent: int
    completed: int
    errors: int
    lost: int
    doubled: int        # bills beyond the first for one request
    unbilled: int       # tokens a client received that no bill holds
    overbilled: int     # tokens billed that no client received
    client: dict        # tenant -> (requests billed, prompt tokens, completion tokens)
    ledger: dict

    @property
    def row(self) -> str:
        return (f"sent={self.sent} completed={self.completed} typed errors={self.errors} "
                f"lost={self.lost} double-billed={self.doubled} unbilled tokens={self.unbilled}")


def tally(outcomes: list[Outcome], rows: dict[str, list[tuple[str, int, int]]]) -> Tally:
    client: dict[str, list[int]] = {t: [0, 0, 0] for t in TENANTS}
    ledger: dict[str, list[int]] = {t: [0, 0, 0] for t in TENANTS}
    doubled = unbilled = overbilled = 0
    for o in outcomes:
        bills = rows.get(o.client_id, [])
        doubled += max(0, len(bills) - 1)
        billed_tokens = bills[0][2] if bills else 0
        unbilled += max(0, o.num_tokens - billed_tokens)
        overbilled += max(0, billed_tokens - o.num_tokens)
        if o.usage is not None or o.num_tokens:   # what must be billed: what reached the client
            c = client[o.tenant]
            c[0] += 1
            c[1] += o.usage.prompt_tokens if o.usage is not None else 0
            c[2] += o.num_tokens
        for tenant, prompt, completion in bills:
            l = ledger.setdefault(tenant, [0, 0, 0])
            l[0] += 1
            l[1] += prompt if o.usage is not None else 0
            l[2] += completion
    known = {o.client_id for o in outcomes}
    for client_id, bills in rows.items():   # billed, yet no client sent it (or it was not counted)
        if client_id not in known:
            overbilled += sum(b[2] for b in bills)
            for tenant, _, completion in bills:
                ledger.setdefault(tenant, [0, 0, 0])[2] += completion
    lost = sum(o.lost for o in outcomes)
    errors = sum(o.code is not None for o in outcomes)
    return Tally(len(outcomes), len(outcomes) - lost - errors, errors, lost, doubled, unbilled,
                 overbilled, {k: tuple(v) for k, v in client.items()},
                 {k: tuple(v) for k, v in ledger.items()})


def report(name: str, outcomes: list[Outcome], mesh, tag: str, settle_s: float = 30) -> Tally:
    """Waits (up to settle_s) for the ledger to hold the clients' records, prints the row, writes
    it under `make chaos`, and asserts the four figures."""
    def settled():
        t = tally(outcomes, ledger_rows(mesh, tag))
        return t if t.client == t.ledger and not (t.doubled or t.unbilled or t.overbilled) else None
    try:
        wait_until(settled, settle_s, interval_s=0.2, what="the ledger to match the clients")
    except AssertionError:
        pass   # reported and asserted below, with the numbers
    time.sleep(1.0)   # a late bill (one that should not be) gets its chance to show
    t = tally(outcomes, ledger_rows(mesh, tag))
    print(f"\n  {name}: {t.row}" + (f" overbilled tokens={t.overbilled}" if t.overbilled else ""))
    if os.environ.get("LLMMESH_CHAOS_REPORT"):   # make chaos: one table row per scenario
        with open(os.environ["LLMMESH_CHAOS_REPORT"], "a") as f:
            f.write(f"| {name} | {t.sent} | {t.completed} | {t.errors} | {t.lost} | {t.doubled} "
                    f"| {t.unbilled} |\n")
    assert t.lost == 0, [o for o in outcomes if o.lost]
    assert t.doubled == 0 and t.unbilled == 0 and t.overbilled == 0, t
    assert t.client == t.ledger, t
    return t


def note(text: str) -> None:
    """A figure for below the table in bench/results/chaos.md (`make chaos` appends the notes
    after the run, so the table's rows stay together)."""
    if os.environ.get("LLMMESH_CHAOS_REPORT"):
        with open(os.environ["LLMMESH_CHAOS_REPORT"] + ".notes", "a") as f:
            f.write(f"- {text}\n")


def health(mesh, name: str, role: Role = Role.WORKER) -> str:
    """A service's grpc.health.v1 status name (SERVING, NOT_SERVING), or the error's code."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    try:
        with mtls.channel(mesh.procs[name].address, MeshIdentity.from_env(Role.ADMIN), role) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except grpc.RpcError as exc:
        return exc.code().name
