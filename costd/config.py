"""costd's start-up configuration: flags over environment over defaults, validated once."""
from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from costd.ledger import LedgerConfig

# Where `llmmesh usage` looks for costd by default.
DEFAULT_LISTEN = "127.0.0.1:50055"
DEFAULT_LEDGER_URL = "sqlite:///var/ledger.sqlite"
# Long enough for in-flight exports to commit, short enough to exit well inside the usual
# 5 s a supervisor waits after SIGTERM.
DEFAULT_GRACE_S = 3.0
LISTEN_ENV = "LLMMESH_COSTD_LISTEN"
LEDGER_URL_ENV = "LLMMESH_LEDGER_URL"


@dataclass(frozen=True, slots=True)
class CostdConfig:
    listen: str = DEFAULT_LISTEN
    ledger: LedgerConfig = field(default_factory=lambda: LedgerConfig.from_url(DEFAULT_LEDGER_URL))
    grace_s: float = DEFAULT_GRACE_S

    def __post_init__(self) -> None:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"listen address must be HOST:PORT, got {self.listen!r}")
        if not math.isfinite(self.grace_s) or self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")


def parse_config(argv: Sequence[str] | None, environ: Mapping[str, str]) -> CostdConfig:
    """Raises SystemExit (argparse) on bad flags, ValueError on bad values."""
    parser = argparse.ArgumentParser(prog="python -m costd", description=__doc__)
    parser.add_argument("--listen", default=environ.get(LISTEN_ENV, DEFAULT_LISTEN),
                        help=f"HOST:PORT for OTLP and CostService (env {LISTEN_ENV})")
    parser.add_argument("--db", default=environ.get(LEDGER_URL_ENV, DEFAULT_LEDGER_URL),
                        help=f"ledger file path or sqlite:/// URL (env {LEDGER_URL_ENV})")
    parser.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S,
                        help="seconds in-flight calls get to finish after SIGTERM")
    args = parser.parse_args(argv)
    return CostdConfig(listen=args.listen, ledger=LedgerConfig.from_url(args.db),
                       grace_s=args.grace_s)
