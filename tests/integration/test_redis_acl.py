"""The private Redis `make up` starts (llmmesh.launcher) has one ACL user per service role
(llmmesh.redis_acl): each may do its role's work and is refused the rest; no password-only or
anonymous login exists; passwords never reach a command line or the world-readable ACL file."""
from __future__ import annotations

import os
import signal
import stat
import time

import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from llmmesh import queue, redis_acl
from llmmesh.billing import BILLING_STREAM
from llmmesh.launcher import Mesh


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory):
    mesh = Mesh(var_dir=str(tmp_path_factory.mktemp("acl")))
    mesh.start_redis()
    mesh.wait_redis()
    try:
        yield mesh
    finally:
        mesh.stop_one("redis")


def _as(mesh, role: str) -> redis.Redis:
    return redis.Redis.from_url(mesh.redis_url_for(role), decode_responses=True)


def test_a_worker_writes_result_streams_and_its_lease_and_nothing_else(private_redis):
    admin, worker = _as(private_redis, "admin"), _as(private_redis, "worker")
    admin.xadd(queue.queue_stream("interactive"), {"d": "{}"})
    stream = queue.result_stream("acme/r1/abc")
    # Allowed: append to a result stream, keep its lease and cache index.
    worker.xadd(stream, queue.tokens_event(0, [1]), id=queue.token_entry_id(0))
    worker.set(queue.worker_key("w0"), "{}", ex=10)
    worker.sadd(queue.worker_cache_key("w0"), "1")
    refused = {}
    for name, call in {
        "read a queue (its entries hold prompts and stream secrets)":
            lambda: worker.xrange(queue.queue_stream("interactive")),
        "read a result stream": lambda: worker.xrange(stream),
        "write a bill": lambda: worker.xadd(BILLING_STREAM, {"d": "{}"}),
        "touch a budget": lambda: worker.hset("llmmesh:budget:{acme}:2026-12", "used", 0),
        "run a script": lambda: worker.eval("return 1", 0),
        "flush everything": lambda: worker.flushall(),
        "list every key": lambda: worker.keys("*"),
        "delete a result stream": lambda: worker.delete(stream),
        "expire a result stream": lambda: worker.expire(stream, 1),
        "overwrite a result stream": lambda: worker.set(stream, "x"),
        "list clients": lambda: worker.client_list(),
        "kill clients": lambda: worker.client_kill_filter(_type="normal"),
        "pause every client": lambda: worker.client_pause(1000),
    }.items():
        with pytest.raises(NoPermissionError):
            call()
        refused[name] = "NOPERM"
    print(f"\n  worker refused: {sorted(refused)}")
    assert admin.xlen(BILLING_STREAM) == 0


def test_gateway_and_router_own_the_queue_protocol_without_the_dangerous_commands(private_redis):
    for role in ("gateway", "router"):
        r = _as(private_redis, role)
        r.xadd(queue.queue_stream("batch"), {"d": "{}"})
        assert r.xrange(queue.queue_stream("batch"))
        assert r.eval("return 1", 0) == 1   # admission's scripts
        for call in (r.flushall, lambda: r.config_get("*"), lambda: r.keys("*"),
                     lambda: r.set("someone-else:key", "x")):
            with pytest.raises(NoPermissionError):
                call()


def test_costd_reads_bills_and_settlements_only_and_keda_queue_depths_only(private_redis):
    r = _as(private_redis, "costd")
    assert r.xrange(BILLING_STREAM) == []
    r.zrangebyscore("llmmesh:settlements:{acme}", 0, "+inf")
    r.time()
    for call in (lambda: r.xadd(BILLING_STREAM, {"d": "{}"}),
                 lambda: r.xrange(queue.queue_stream("interactive")),   # prompts, stream secrets
                 lambda: r.xrange(queue.result_stream("acme/r1/abc")),  # completions
                 lambda: r.client_list()):
        with pytest.raises(NoPermissionError):
            call()
    keda = _as(private_redis, "keda")
    assert keda.xlen(queue.queue_stream("interactive")) >= 0
    with pytest.raises(NoPermissionError):
        keda.xrange(queue.queue_stream("interactive"))


def test_no_anonymous_or_password_only_login_and_no_password_in_the_open(private_redis):
    port = private_redis.procs["redis"].address.rsplit(":", 1)[1]
    with pytest.raises((AuthenticationError, ResponseError)):
        redis.Redis(port=int(port)).get("x")                       # no login as the default user
    password = redis_acl.password_path(private_redis.redis_credentials, "admin").read_text().strip()
    with pytest.raises((AuthenticationError, ResponseError)):
        redis.Redis(port=int(port), password=password).get("x")   # a password alone is no user
    with pytest.raises((AuthenticationError, ResponseError)):
        redis.Redis(port=int(port), username="worker", password=password).get("x")
    directory = private_redis.redis_credentials
    acl = open(os.path.join(directory, redis_acl.ACL_FILE)).read()
    for role in redis_acl.ROLES:
        path = redis_acl.password_path(directory, role)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_text().strip() not in acl                # digests only
    admin_url = os.path.join(directory, "admin.url")        # for operators' tools, 0600
    assert stat.S_IMODE(os.stat(admin_url).st_mode) == 0o600
    assert open(admin_url).read() == private_redis.redis_url
    argv = open(f"/proc/{private_redis.procs['redis'].popen.pid}/cmdline").read()
    assert password not in argv


def test_a_service_reads_its_password_from_the_credentials_directory(tmp_path):
    redis_acl.ensure(tmp_path)
    env = {redis_acl.CREDENTIALS_ENV: str(tmp_path)}
    url = redis_acl.service_url("redis://redis:6379/0", "worker", env)
    password = redis_acl.password_path(tmp_path, "worker").read_text().strip()
    assert url == f"redis://worker:{password}@redis:6379/0"
    # A URL that names its own user is the operator's choice, kept as given.
    assert redis_acl.service_url("redis://me:pw@redis:6379/0", "worker", env) == "redis://me:pw@redis:6379/0"
    assert redis_acl.service_url("redis://redis:6379/0", "worker", {}) == "redis://redis:6379/0"
    before = password
    redis_acl.ensure(tmp_path)                                    # kept across restarts
    assert redis_acl.password_path(tmp_path, "worker").read_text().strip() == before


def test_a_transaction_a_role_wrote_survives_a_crash_and_a_restart_on_the_aof(private_redis):
    """Redis replays its AOF as the default user and re-checks each MULTI/EXEC against it
    (redis/redis#14541): with the default user off, a router's final + bill transaction was
    silently dropped at restart (chaos Q1 found it: 21 unbilled tokens)."""
    router = _as(private_redis, "router")
    stream = queue.result_stream("acme/aof/1")
    with router.pipeline(transaction=True) as pipe:
        pipe.xadd(stream, queue.final_event("stop", {}))
        pipe.xadd(BILLING_STREAM, {"d": "{}"})
        pipe.execute()
    time.sleep(1.5)                                       # appendfsync everysec
    port = int(private_redis.procs["redis"].address.rsplit(":", 1)[1])
    private_redis.stop_one("redis", signal.SIGKILL)
    private_redis.start_redis(port)
    private_redis.wait_redis()
    admin = _as(private_redis, "admin")
    assert admin.xlen(stream) == 1 and admin.xlen(BILLING_STREAM) >= 1
    log = open(os.path.join(private_redis.log_dir, "redis.log")).read()
    assert "NOPERM" not in log


def test_a_relative_var_dir_works(tmp_path, monkeypatch):
    """redis-server enters its `dir` before it reads the ACL file: a relative path in its
    config was looked up from there and Redis refused to start (make bench-overhead's var/...)."""
    monkeypatch.chdir(tmp_path)
    mesh = Mesh(var_dir="var/rel")
    mesh.start_redis()
    try:
        mesh.wait_redis()   # raises naming the log if redis-server exited
        assert redis.Redis.from_url(mesh.redis_url).ping()
    finally:
        mesh.stop_one("redis")
