"""Redis ACL users, one per service role, each allowed only what its role does.

A worker runs model code and there are many of them: it may XADD to result streams (never
read, delete or expire one: llmmesh.streamauth signs what it writes) and keep leases and cache
indexes (one user for every worker, so any worker's: the router checks that a lease's key
names its worker), and nothing else — it cannot read the queues (whose entries carry each
request's stream secret and prompt), write a bill into the billing stream, or touch admission's
budgets. costd reads only the billing stream and the settlements (the reconciler); `keda` reads
only queue depths (KEDA's scaler). The gateway and routers own the queue protocol and
get every llmmesh key, without the dangerous commands (FLUSHALL, CONFIG, DEBUG, KEYS...). The
`admin` user (operators, `llmmesh reconcile`, the tests) may do anything. Nobody can log in as
the default user (its password is random and kept nowhere; see ensure()): there is no
anonymous or password-only login.

`ensure(directory)` writes one password per role (`redis-<role>.password`, 0600) and the ACL file
Redis loads (`redis-users.acl`, holding only SHA-256 digests of the passwords, so it may be
world-readable for a Redis container). A service finds its password through
LLMMESH_REDIS_CREDENTIALS=<directory> when its REDIS_URL names no user (compose, Kubernetes);
`make up` puts each service's user and password into the REDIS_URL it hands that service by
environment, never on a command line.
"""
from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from llmmesh.atomic_file import write_atomic

CREDENTIALS_ENV = "LLMMESH_REDIS_CREDENTIALS"
ACL_FILE = "redis-users.acl"

# AUTH, HELLO, PING, SELECT, CLIENT SETINFO...; not CLIENT KILL / PAUSE / LIST (dangerous).
_CONNECT = "+@connection -@dangerous"
_OWNERS = "~llmmesh:* &llmmesh:* +@all -@dangerous"
RULES: dict[str, str] = {
    "gateway": _OWNERS,
    "router": _OWNERS,
    # Its lease and cache index (any worker's: one user for all workers), and, through a
    # selector, XADD to result streams and nothing else there (no read, no DEL, no EXPIRE).
    "worker": (f"~llmmesh:worker:* ~llmmesh:cache:* -@all {_CONNECT} "
               "+set +get +del +expire +sadd +smembers +multi +exec +discard "
               "(%W~llmmesh:res:* -@all +xadd)"),
    # The reconciler: bills not yet shipped and admission's settlements, read-only. (KEDA
    # reads queue depths as its own user.)
    "costd": (f"%R~llmmesh:billing %R~llmmesh:settlements:* -@all {_CONNECT} "
              "+@read +time +scan"),
    "keda": f"%R~llmmesh:q:* -@all {_CONNECT} +xlen +xpending +xinfo",
    "admin": "~* &* +@all",
}
ROLES = tuple(RULES)


# `make up` leaves the admin user's URL in its credentials directory (0600), for operators'
# tools on this machine: var/redis-users/admin.url by default.
ADMIN_URL_FILE = "admin.url"
LOCAL_ADMIN_URL = Path("var/redis-users") / ADMIN_URL_FILE


def local_admin_url(environ: Mapping[str, str] = os.environ) -> str:
    """REDIS_URL if set, else the URL `make up` left for operators, else the local default."""
    if environ.get("REDIS_URL"):
        return environ["REDIS_URL"]
    try:
        return LOCAL_ADMIN_URL.read_text().strip()
    except OSError:
        return "redis://127.0.0.1:6379/0"


def password_path(directory: str | Path, role: str) -> Path:
    return Path(directory) / f"redis-{role}.password"


def ensure(directory: str | Path, rotate: bool = False) -> Path:
    """Every role's password (kept when present, new when missing or `rotate`) and the ACL file
    built from them; returns the ACL file's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # The default user is what Redis replays its append-only file as (without logging in), and
    # Redis 7 re-checks a replayed MULTI/EXEC against it: with the default user off, every
    # transaction in the file is dropped on restart (redis/redis#14541) — the finals and bills
    # written together. So it keeps every permission, behind a random password thrown away
    # here: nobody can log in as it, the loader needs no login.
    lines = [f"user default on #{hashlib.sha256(secrets.token_bytes(32)).hexdigest()} ~* &* +@all"]
    for role in ROLES:
        path = password_path(directory, role)
        if rotate or not path.exists():
            write_atomic(str(path), [secrets.token_urlsafe(24).encode() + b"\n"])   # 0600
        digest = hashlib.sha256(path.read_text().strip().encode()).hexdigest()
        lines.append(f"user {role} on #{digest} resetkeys resetchannels {RULES[role]}")
    acl = directory / ACL_FILE
    write_atomic(str(acl), ["\n".join(lines).encode() + b"\n"])
    os.chmod(acl, 0o644)   # digests only: Redis (another uid in a container) must read it
    return acl


def with_user(url: str, role: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{quote(role)}:{quote(password, safe='')}@{host}"))


def service_url(url: str, role: str, environ: Mapping[str, str] = os.environ) -> str:
    """The Redis URL a service of `role` connects with: `url` as given when it names a user or
    password, else `url` with the role's user and its password from LLMMESH_REDIS_CREDENTIALS."""
    directory = environ.get(CREDENTIALS_ENV)
    if not directory or "@" in urlsplit(url).netloc:
        return url
    path = password_path(directory, role)
    try:
        password = path.read_text().strip()
    except OSError as exc:
        raise SystemExit(f"{CREDENTIALS_ENV}={directory}: cannot read {path.name} ({exc.strerror}); "
                         "run `llmmesh certs` on that directory") from exc
    return with_user(url, role, password)
