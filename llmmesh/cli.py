"""The `llmmesh` command: up, generate, usage, hash-key."""
from __future__ import annotations

import asyncio
import os
import signal
import sys

import grpc
import typer

from llmmesh.aio import wait_event
from llmmesh.v1 import common_pb2, cost_pb2, cost_pb2_grpc, gateway_pb2, gateway_pb2_grpc

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="llmmesh: a multi-tenant LLM inference mesh.")

DEMO_KEYS = {"acme": "llmmesh-demo-acme", "globex": "llmmesh-demo-globex"}


def _port_free(address: str) -> bool:
    import socket
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


@app.command()
def up(workers: int = typer.Option(1, help="worker processes"),
       gateway: str = typer.Option("127.0.0.1:50051", help="gateway listen address"),
       costd: str = typer.Option("127.0.0.1:50055", help="costd listen address"),
       http: str = typer.Option("127.0.0.1:8000", help="the gateway's OpenAI-compatible HTTP address"),
       var_dir: str = typer.Option("var", help="ledger, logs and redis files")) -> None:
    """Start redis (unless REDIS_URL is set), costd, workers, router and gateway; Ctrl-C stops all."""
    from llmmesh.launcher import Mesh
    for name, address in (("gateway", gateway), ("costd", costd), ("http", http)):
        if not _port_free(address):
            typer.echo(f"{address} is in use; pass --{name} HOST:PORT", err=True)
            raise typer.Exit(2)
    # die_with_parent: should this process be killed outright, its services and Redis stop too.
    mesh = Mesh(var_dir=os.path.abspath(var_dir), redis_url=os.environ.get("REDIS_URL"),
                die_with_parent=True)
    stop = asyncio.Event()
    parent = os.getppid()
    # Under make (`make up`, which sets MAKELEVEL) the mesh lives as long as make: `timeout 60
    # make up` signals make alone, and make exits without passing it on. Started otherwise,
    # a parent that exits is no reason to stop (`nohup llmmesh up &`, then closing the shell).
    watch_parent = "MAKELEVEL" in os.environ
    # SIGHUP (the terminal closed) stops it as Ctrl-C does, unless it was ignored (nohup).
    signals = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        signals.append(signal.SIGHUP)

    async def run():
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.add_signal_handler(sig, stop.set)
        typer.echo("starting the mesh (the worker loads the model; logs in "
                   f"{mesh.log_dir}) ...")
        await mesh.up(num_workers=workers, gateway_listen=gateway, costd_listen=costd,
                      http_listen=http)
        mesh.write_metrics_targets()
        _print_ready(mesh)
        while not stop.is_set():
            dead = [p.name for p in mesh.procs.values() if not p.alive()]
            if dead:
                typer.echo(f"{', '.join(dead)} exited; stopping the mesh (see {mesh.log_dir})", err=True)
                break
            if watch_parent and os.getppid() != parent:
                typer.echo("make, which started llmmesh up, exited; stopping the mesh", err=True)
                break
            await wait_event(stop, 1.0)

    try:
        asyncio.run(run())
    finally:
        typer.echo("stopping every process ...")
        mesh.down()
        typer.echo("stopped.")


def _print_ready(mesh) -> None:
    from llmmesh.launcher import redacted
    gw, cd = mesh.procs["gateway"].address, mesh.procs["costd"].address
    base = mesh.openai_base_url
    typer.echo(f"\nllmmesh is up.\n  gateway  {gw} (gRPC)\n  openai   {base} (HTTP, OpenAI-compatible)"
               f"\n  costd    {cd}\n  redis    {redacted(mesh.redis_url)}")
    scrape = [f"{n}={p.metrics_address}" for n, p in mesh.procs.items() if p.metrics_address]
    typer.echo(f"  metrics  http://<address>/metrics: {', '.join(scrape)} "
               f"(live view: .venv/bin/llmmesh top --var-dir {mesh.var_dir})")
    for tenant, key in DEMO_KEYS.items():
        typer.echo(f"  tenant {tenant:<7} API key {key}")
    typer.echo(f"  admin key (fleet-wide bills) in {mesh.admin_key_path}, mode 0600")
    typer.echo("\nTry:\n"
               f"  .venv/bin/llmmesh generate --gateway {gw} --api-key {DEMO_KEYS['acme']} "
               "\"What is the capital of Japan?\"\n"
               f"  .venv/bin/llmmesh usage --costd {cd} --tenant acme\n"
               f"  LLMMESH_ADMIN_KEY_FILE={mesh.admin_key_path} .venv/bin/llmmesh bill --costd {cd}\n"
               "\nOr with the openai SDK (pip install openai):\n"
               "  from openai import OpenAI\n"
               f"  client = OpenAI(base_url=\"{base}\", api_key=\"{DEMO_KEYS['acme']}\")\n"
               "  r = client.chat.completions.create(model=\"smollm2-135m-instruct\",\n"
               "      messages=[{\"role\": \"user\", \"content\": \"What is the capital of Japan?\"}])\n"
               "  print(r.choices[0].message.content, r.usage)\n"
               "\nCtrl-C stops everything.")


@app.command()
def generate(prompt: str,
             gateway: str = typer.Option("127.0.0.1:50051", help="gateway address"),
             api_key: str = typer.Option(..., envvar="LLMMESH_API_KEY", help="tenant API key"),
             batch: bool = typer.Option(False, "--batch", help="send as a batch-class request"),
             raw: bool = typer.Option(False, "--raw", help="send the prompt as is, without the chat template"),
             max_tokens: int = typer.Option(128, help="maximum tokens to generate"),
             temperature: float = typer.Option(0.0, help="0 = greedy"),
             model: str = typer.Option("", help="model name (default: the gateway's default)"),
             ca: str = typer.Option("", help="CA certificate (PEM) of a gateway serving TLS; "
                                    "empty: plaintext (loopback demo)")) -> None:
    """Stream a completion to stdout; usage goes to stderr."""
    req = gateway_pb2.GenerateRequest(
        model=model, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature),
        request_class=common_pb2.REQUEST_CLASS_BATCH if batch else common_pb2.REQUEST_CLASS_INTERACTIVE)
    if raw:
        req.prompt = prompt
    else:
        req.messages.add(role="user", content=prompt)
    channel = (grpc.secure_channel(gateway, grpc.ssl_channel_credentials(open(ca, "rb").read()))
               if ca else grpc.insecure_channel(gateway))
    with channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        try:
            for msg in stub.Generate(req, metadata=(("authorization", f"Bearer {api_key}"),)):
                if msg.HasField("chunk"):
                    sys.stdout.write(msg.chunk.text)
                    sys.stdout.flush()
                else:
                    u = msg.final.usage
                    sys.stdout.write("\n")
                    typer.echo(f"[{msg.final.request_id}] prompt_tokens={u.prompt_tokens} "
                               f"cached={u.cached_prompt_tokens} completion_tokens={u.completion_tokens} "
                               f"finish={common_pb2.FinishReason.Name(msg.final.finish_reason)}", err=True)
        except grpc.RpcError as exc:
            typer.echo(f"\nerror: {exc.code().name}: {exc.details()}", err=True)
            raise typer.Exit(1)


@app.command()
def usage(tenant: str = typer.Option(..., help="tenant id"),
          costd: str = typer.Option("127.0.0.1:50055", help="costd address")) -> None:
    """Print a tenant's billed tokens (its own key in LLMMESH_API_KEY, or the admin key)."""
    from llmmesh.cli_cost import costd_channel, credentials
    metadata = credentials(tenant)
    with costd_channel(costd) as channel:
        try:
            r = cost_pb2_grpc.CostServiceStub(channel).GetUsage(
                cost_pb2.GetUsageRequest(tenant_id=tenant), metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            typer.echo(f"error: {exc.code().name}: {exc.details()}", err=True)
            raise typer.Exit(1)
    typer.echo(f"tenant {r.tenant_id}: requests={r.requests} prompt_tokens={r.prompt_tokens} "
               f"cached_prompt_tokens={r.cached_prompt_tokens} completion_tokens={r.completion_tokens} "
               f"prefill_device_s={r.prefill_device_seconds:.3f} decode_device_s={r.decode_device_seconds:.3f}")


@app.command()
def certs(directory: str = typer.Argument("var/tls", help="where the CA and certificates go"),
          rotate: bool = typer.Option(False, help="issue every role's certificate anew (same CA)"),
          dns: list[str] = typer.Option([], help="extra DNS name in every certificate (repeatable)")) -> None:
    """Create the mesh's private CA and one certificate per role (files 0600): for compose, a
    Kubernetes Secret per role, or `make up` (which does this itself on first run)."""
    from llmmesh import certs as mesh_certs
    from llmmesh import redis_acl
    issued = mesh_certs.ensure(directory, rotate=rotate, extra_dns=dns)
    # Redis's ACL users too (one per role): the passwords 0600 beside the keys, the ACL file
    # (digests only) readable by a Redis that runs as another user, hence a traversable directory.
    acl = redis_acl.ensure(directory)
    os.chmod(directory, 0o711)
    typer.echo(f"{directory}: issued {', '.join(r.value for r in issued) or 'nothing (all present)'}; "
               f"services read it through LLMMESH_TLS_DIR={directory}; Redis users in {acl} "
               f"(redis-server --aclfile), services find their password through "
               f"{redis_acl.CREDENTIALS_ENV}={directory}")


@app.command("hash-key")
def hash_key(api_key: str) -> None:
    """Print the SHA-256 digest to put in the tenants file for a new API key."""
    import hashlib
    typer.echo(hashlib.sha256(api_key.encode()).hexdigest())


def _register_extensions() -> None:
    """Commands that live in their own modules (billing, benchmarks) add themselves here."""
    import importlib
    for module in ("llmmesh.cli_batch", "llmmesh.cli_cost", "llmmesh.cli_bench", "llmmesh.cli_top",
                   "llmmesh.cli_reconcile"):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        mod.register(app)


_register_extensions()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
