"""`python -m costd --listen HOST:PORT --db var/ledger.sqlite [--prices FILE]`: the billing daemon."""
from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import sys

from costd.app import serve
from costd.config import parse_config
from costd.pipeline import PipelineError
from llmmesh.server import configure_logging


def main(argv: list[str] | None = None) -> int:
    configure_logging("costd")
    try:
        config = parse_config(argv, os.environ)
    except ValueError as error:
        print(f"costd: {error}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except (OSError, RuntimeError, ValueError, sqlite3.Error, PipelineError) as error:
        # Start-up failures (port taken, ledger unreadable, bad price book, curve or tenants
        # file) get one line, not a traceback.
        logging.getLogger("costd").error("costd failed: %s", error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
