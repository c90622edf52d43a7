"""Starts the whole mesh as local processes (`llmmesh up`, end-to-end tests) and stops it cleanly."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from llmmesh import certs, redis_acl
from llmmesh.apikeys import DEMO_ADMIN_KEY, write_admin_key
from llmmesh.atomic_file import write_atomic
from llmmesh.identity import Role
from llmmesh.mtls import TLS_DIR_ENV, MeshIdentity
from llmmesh.server import wait_serving

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_redis_server() -> str:
    path = shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/local/bin/redis-server") if os.path.exists(p)), None)
    if path is None:
        raise FileNotFoundError("redis-server not found; install it with: "
                                "sudo apt-get update && sudo apt-get install -y redis-server")
    return path


def redacted(url: str | None) -> str:
    """A Redis URL fit to print: the password replaced."""
    if not url or "@" not in url:
        return url or ""
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"


_PR_SET_PDEATHSIG = 1


def _die_with(parent_pid: int):
    """For Popen's preexec_fn: the child gets SIGTERM when `parent_pid` dies (Linux prctl)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:   # it died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)
    return preexec


_SERVER_ROLES = {"router": Role.ROUTER, "worker": Role.WORKER, "costd": Role.COSTD}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    address: str | None = None
    http_address: str | None = None   # the gateway's OpenAI-compatible HTTP front
    metrics_address: str | None = None   # Prometheus metrics (http://<this>/metrics)

    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class Mesh:
    """The processes of one local mesh. Tests reach into `procs` to kill and restart parts."""

    var_dir: str
    redis_url: str | None = None
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    # More OTLP receivers beside costd (a tracing backend; tests capture spans this way).
    extra_otlp_endpoints: list[str] = field(default_factory=list)
    procs: dict[str, Proc] = field(default_factory=dict)
    _starts: dict[str, tuple] = field(default_factory=dict, repr=False)
    log_dir: str = ""
    # The mesh's CA and role certificates; default LLMMESH_TLS_DIR, else <var_dir>/tls (made here).
    tls_dir: str = ""
    # Where the private Redis's per-role passwords live (start_redis); "" for a given REDIS_URL.
    redis_credentials: str = ""
    # Every process started here gets SIGTERM when the process that started it dies, even by
    # SIGKILL (`llmmesh up` sets it). Linux's parent-death signal fires when the *thread* that
    # forked exits, so set it only where every start comes from a thread that lives as long as
    # the mesh (the CLI starts all from its main thread; tests may start from pool threads).
    die_with_parent: bool = False

    def __post_init__(self):
        # Absolute: services run from the repository root, and redis-server from its `dir`.
        self.var_dir = os.path.abspath(self.var_dir)
        os.makedirs(self.var_dir, exist_ok=True)
        self.log_dir = self.log_dir or os.path.join(self.var_dir, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self.tls_dir = self.tls_dir or os.environ.get(TLS_DIR_ENV) or os.path.join(self.var_dir, "tls")
        certs.ensure(self.tls_dir)
        # The demo's admin key (config/tenants.toml's [admin]) for `llmmesh bill`, as the demo
        # tenant keys are: kept when there, so an operator's own key is never overwritten.
        self.admin_key_path = os.path.join(self.var_dir, "admin.key")
        if not os.path.exists(self.admin_key_path):
            write_admin_key(self.admin_key_path, DEMO_ADMIN_KEY)
        self.env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    "PYTHONUNBUFFERED": "1", TLS_DIR_ENV: self.tls_dir}

    def write_metrics_targets(self) -> str:
        """<var_dir>/metrics-targets.json: service name -> metrics address (`llmmesh top`)."""
        path = os.path.join(self.var_dir, "metrics-targets.json")
        with open(path, "w") as f:
            json.dump({n: p.metrics_address for n, p in self.procs.items() if p.metrics_address}, f)
        return path

    @property
    def openai_base_url(self) -> str:
        """The gateway's OpenAI-compatible base URL (plaintext on loopback)."""
        return f"http://{self.procs['gateway'].http_address}/v1"

    def identity(self, role: Role = Role.ADMIN) -> MeshIdentity:
        """A role's certificate in this mesh (tests call internal ports as ADMIN or another role)."""
        return MeshIdentity(Path(self.tls_dir), role)

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        return subprocess.Popen(argv, cwd=REPO_ROOT, env={**self.env, **(env or {})},
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with(os.getpid()) if self.die_with_parent else None)

    def start_redis(self, port: int | None = None) -> str:
        """A private redis-server that needs a password (kept in a 0600 config file, never on a
        command line) and keeps an append-only file (fsync every second)."""
        port = port or free_port()
        conf = os.path.join(self.var_dir, "redis.conf")
        # One ACL user per service role (llmmesh.redis_acl); passwords kept across restarts,
        # so running clients reconnect.
        self.redis_credentials = os.path.join(self.var_dir, "redis-users")
        acl = redis_acl.ensure(self.redis_credentials)
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"port {port}\nbind 127.0.0.1\nprotected-mode yes\naclfile {acl}\n"
                    f'save ""\nappendonly yes\nappendfsync everysec\ndir {self.var_dir}\n')
        self.procs["redis"] = Proc("redis", self._spawn("redis", [find_redis_server(), conf]),
                                   f"127.0.0.1:{port}")
        self.redis_url = self.redis_url_for("admin")
        # For operators' tools on this machine (`llmmesh reconcile`): 0600, like the passwords.
        write_atomic(os.path.join(self.redis_credentials, redis_acl.ADMIN_URL_FILE),
                     [self.redis_url.encode()])
        return self.redis_url

    def wait_redis(self, timeout_s: float = 10.0) -> None:
        """Until the private Redis answers (loading its append-only file counts as not yet);
        a redis-server that exited meanwhile fails at once, naming its log."""
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    client.ping()
                    return
                except (redis.ConnectionError, redis.BusyLoadingError):
                    if not self.procs["redis"].alive():
                        raise RuntimeError("redis-server exited; see "
                                           f"{os.path.join(self.log_dir, 'redis.log')}") from None
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            client.close()

    def redis_url_for(self, role: str) -> str | None:
        """The URL a service of `role` gets: its own ACL user on the private Redis, or the URL
        the caller gave (their Redis, their users)."""
        if not self.redis_credentials:
            return self.redis_url
        port = self.procs["redis"].address.rsplit(":", 1)[1]
        password = redis_acl.password_path(self.redis_credentials, role).read_text().strip()
        return redis_acl.with_user(f"redis://127.0.0.1:{port}/0", role, password)

    def start_service(self, name: str, module: str, extra: list[str] | None = None,
                      address: str | None = None, http_listen: str | None = None) -> Proc:
        # Kept to start it again on other ports should a port picked here be taken meanwhile.
        self._starts[name] = (module, list(extra or []), address, http_listen)
        address = address or f"127.0.0.1:{free_port()}"
        # The Redis URL (with its password) goes by environment: argv is visible to every user.
        argv = [sys.executable, "-m", module, "--listen", address]
        if module == "costd":
            argv = [sys.executable, "-m", "costd", "--listen", address,
                    "--db", os.path.join(self.var_dir, "ledger.sqlite")]
            if "--tenants" in self.gateway_args:   # one key file: the gateway's keys read bills
                argv += ["--tenants", self.gateway_args[self.gateway_args.index("--tenants") + 1]]
        else:
            endpoints = [self.procs["costd"].address, *self.extra_otlp_endpoints]
            argv += ["--otlp-endpoint", ",".join(endpoints)]
            if module == "router":   # bills go to costd alone, not to every trace receiver
                argv += ["--costd", self.procs["costd"].address]
        http = None
        if module == "gateway":
            extra = list(extra or [])
            if "--http-listen" in extra:
                http = extra[extra.index("--http-listen") + 1] or None
            else:
                http = http_listen or f"127.0.0.1:{free_port()}"
                extra += ["--http-listen", http]
        extra = list(extra or [])
        metrics = None
        if "--metrics-port" not in extra:
            metrics = f"127.0.0.1:{free_port()}"
            extra += ["--metrics-port", metrics.rsplit(":", 1)[1]]
        role = "worker" if module == "workers" else module
        proc = Proc(name, self._spawn(name, argv + extra, {"REDIS_URL": self.redis_url_for(role) or ""}),
                    address, http, metrics)
        self.procs[name] = proc
        return proc

    async def wait_ready(self, names: list[str], timeout_s: float = 120.0) -> None:
        async def one(name: str):
            proc = self.procs[name]
            deadline = time.monotonic() + timeout_s
            retried = False
            while True:
                if not proc.alive():
                    if not retried and self._lost_port_race(name):
                        # free_port() releases the port before the service binds it: another
                        # process can take it in between. Once: start it again on new ports.
                        retried = True
                        module, extra, address, http_listen = self._starts[name]
                        proc = self.start_service(name, module, extra, address, http_listen)
                        continue
                    raise RuntimeError(f"{name} exited with {proc.popen.returncode}; "
                                       f"see {os.path.join(self.log_dir, name + '.log')}")
                try:
                    # The gateway's public port is plaintext on loopback; every other is mTLS.
                    role = _SERVER_ROLES.get(name.rstrip("0123456789"))
                    await wait_serving(proc.address, timeout_s=1.0, server_role=role,
                                       caller=self.identity() if role else None)
                    return
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise
        await asyncio.gather(*(one(n) for n in names))

    async def up(self, num_workers: int = 1, timeout_s: float = 180.0,
                 gateway_listen: str | None = None, costd_listen: str | None = None,
                 num_routers: int = 1, http_listen: str | None = None) -> None:
        if not self.redis_url:
            self.start_redis()
        self.start_service("costd", "costd", address=costd_listen)
        await self.wait_ready(["costd"], timeout_s)
        for i in range(num_workers):
            self.start_worker(f"worker{i}")
        for i in range(num_routers):
            name = "router" if i == 0 else f"router{i}"
            self.start_service(name, "router", ["--consumer", name, *self.router_args])
        self.start_service("gateway", "gateway", self.gateway_args, address=gateway_listen,
                           http_listen=http_listen)
        await self.wait_ready([n for n in self.procs if n not in ("redis", "costd")], timeout_s)

    def _lost_port_race(self, name: str) -> bool:
        """The service exited because a port the launcher picked for it was taken."""
        if name not in self._starts or self._starts[name][2]:   # an address given: not ours
            return False
        try:
            with open(os.path.join(self.log_dir, name + ".log"), errors="replace") as f:
                return "address already in use" in f.read()[-20_000:].lower()
        except OSError:
            return False

    def start_worker(self, name: str) -> Proc:
        return self.start_service(name, "workers", ["--worker-id", name, *self.worker_args])

    def restart_redis(self) -> None:
        """Kill redis-server and start a fresh, empty one on the same port."""
        self.stop_one("redis", signal.SIGKILL)
        shutil.rmtree(os.path.join(self.var_dir, "appendonlydir"), ignore_errors=True)
        self.start_redis(int(self.procs["redis"].address.rsplit(":", 1)[1]))

    def stop_one(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int | None:
        proc = self.procs.get(name)
        if proc is None or not proc.alive():
            return proc.popen.returncode if proc else None
        proc.popen.send_signal(sig)
        try:
            return proc.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            return proc.popen.wait()

    def down(self) -> None:
        """Stop in reverse dependency order: front door first, redis last."""
        order = ["gateway", "router", *[n for n in self.procs if n.startswith("worker")], "costd", "redis"]
        for name in order + [n for n in self.procs if n not in order]:
            self.stop_one(name)
