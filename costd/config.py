"""costd's start-up configuration: flags over environment over defaults, validated once."""
from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from costd.costmodel import IdlePolicy
from costd.ledger import LedgerConfig
from llmmesh import metrics

# Where `llmmesh usage` looks for costd by default.
DEFAULT_LISTEN = "127.0.0.1:50055"
DEFAULT_LEDGER_URL = "sqlite:///var/ledger.sqlite"
# Found from the code, not the working directory, so `python -m costd` works from anywhere.
_REPO = Path(__file__).resolve().parents[1]
DEFAULT_PRICES = str(_REPO / "config" / "prices.toml")
DEFAULT_CURVES_DIR = str(_REPO / "bench" / "curves")
# The gateway's file: tenant keys read their own bills, its [admin] keys the fleet's.
DEFAULT_TENANTS = str(_REPO / "config" / "tenants.toml")
# Long enough for in-flight exports to commit, short enough to exit well inside the usual
# 5 s a supervisor waits after SIGTERM.
DEFAULT_GRACE_S = 3.0
LISTEN_ENV = "LLMMESH_COSTD_LISTEN"
LEDGER_URL_ENV = "LLMMESH_LEDGER_URL"
PRICES_ENV = "LLMMESH_PRICES"
CURVES_ENV = "LLMMESH_CURVES_DIR"
TENANTS_ENV = "LLMMESH_TENANTS_FILE"   # the gateway's variable too: one file for both
IDLE_POLICY_ENV = "LLMMESH_IDLE_POLICY"
TLS_DIR_ENV = "LLMMESH_TLS_DIR"
REDIS_URL_ENV = "REDIS_URL"
RECONCILE_INTERVAL_ENV = "LLMMESH_RECONCILE_INTERVAL_S"
DEFAULT_RECONCILE_INTERVAL_S = 300.0


@dataclass(frozen=True, slots=True)
class CostdConfig:
    listen: str = DEFAULT_LISTEN
    ledger: LedgerConfig = field(default_factory=lambda: LedgerConfig.from_url(DEFAULT_LEDGER_URL))
    grace_s: float = DEFAULT_GRACE_S
    prices_path: str = DEFAULT_PRICES
    curves_dir: str = DEFAULT_CURVES_DIR
    tenants_path: str = DEFAULT_TENANTS
    idle_policy: IdlePolicy = IdlePolicy.UNUSED
    # ca.pem, costd.pem, costd.key (llmmesh certs); None: LLMMESH_TLS_DIR.
    tls_dir: str | None = None
    metrics_port: int = -1          # Prometheus metrics (0: any free port; -1: off)
    metrics_host: str = "127.0.0.1"
    # Reconciliation with Redis's settlements and billing records (costd.reconcile): every
    # interval, when a Redis URL is given; 0 disables it.
    redis_url: str = ""
    reconcile_interval_s: float = DEFAULT_RECONCILE_INTERVAL_S

    def __post_init__(self) -> None:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"listen address must be HOST:PORT, got {self.listen!r}")
        if not math.isfinite(self.grace_s) or self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if not isinstance(self.idle_policy, IdlePolicy):
            raise ValueError(f"idle_policy must be an IdlePolicy, got {self.idle_policy!r}")
        if not math.isfinite(self.reconcile_interval_s) or self.reconcile_interval_s < 0:
            raise ValueError(f"reconcile_interval_s must be >= 0, got {self.reconcile_interval_s}")


def parse_config(argv: Sequence[str] | None, environ: Mapping[str, str]) -> CostdConfig:
    """Raises SystemExit (argparse) on bad flags, ValueError on bad values."""
    parser = argparse.ArgumentParser(prog="python -m costd", description=__doc__)
    parser.add_argument("--listen", default=environ.get(LISTEN_ENV, DEFAULT_LISTEN),
                        help=f"HOST:PORT for OTLP and CostService (env {LISTEN_ENV})")
    parser.add_argument("--db", default=environ.get(LEDGER_URL_ENV, DEFAULT_LEDGER_URL),
                        help="ledger: file path, sqlite:/// URL or postgresql:// URL "
                             f"(env {LEDGER_URL_ENV})")
    parser.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S,
                        help="seconds in-flight calls get to finish after SIGTERM")
    parser.add_argument("--prices", default=environ.get(PRICES_ENV, DEFAULT_PRICES),
                        help=f"price book TOML (env {PRICES_ENV})")
    parser.add_argument("--curves-dir", default=environ.get(CURVES_ENV, DEFAULT_CURVES_DIR),
                        help=f"throughput curves for what-if (env {CURVES_ENV})")
    parser.add_argument("--tenants", default=environ.get(TENANTS_ENV, DEFAULT_TENANTS),
                        help="API keys (tenants' and [admin]) that may read bills, reloaded "
                             f"when it changes (env {TENANTS_ENV})")
    parser.add_argument("--idle-policy", default=environ.get(IDLE_POLICY_ENV, "unused"),
                        choices=[p.value for p in IdlePolicy],
                        help=f"default idle capacity policy (env {IDLE_POLICY_ENV})")
    parser.add_argument("--tls-dir", default=environ.get(TLS_DIR_ENV),
                        help=f"the mesh's TLS files (env {TLS_DIR_ENV})")
    parser.add_argument("--redis-url", default=environ.get(REDIS_URL_ENV, ""),
                        help=f"Redis, for reconciling bills with settlements (env {REDIS_URL_ENV})")
    parser.add_argument("--reconcile-interval-s", type=float,
                        default=float(environ.get(RECONCILE_INTERVAL_ENV,
                                                  DEFAULT_RECONCILE_INTERVAL_S)),
                        help=f"seconds between reconciliations, 0: off (env {RECONCILE_INTERVAL_ENV})")
    metrics.add_arguments(parser, environ)
    args = parser.parse_args(argv)
    return CostdConfig(listen=args.listen, ledger=LedgerConfig.from_url(args.db),
                       grace_s=args.grace_s, prices_path=args.prices,
                       curves_dir=args.curves_dir, tenants_path=args.tenants,
                       idle_policy=IdlePolicy(args.idle_policy),
                       tls_dir=args.tls_dir, metrics_port=args.metrics_port,
                       metrics_host=args.metrics_host, redis_url=args.redis_url,
                       reconcile_interval_s=args.reconcile_interval_s)
