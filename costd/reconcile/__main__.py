"""`python -m costd.reconcile [--since-s 3600] [--repair] [--json]`: one reconciliation, here.

Used by `llmmesh reconcile`; reads the ledger (--db, or LLMMESH_LEDGER_URL) and Redis
(--redis-url, or REDIS_URL) directly, so it works while costd is down. Exit status: 0 no gap
left open, 1 gaps left open, 2 it could not run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from costd.config import DEFAULT_LEDGER_URL, LEDGER_URL_ENV
from costd.ledger import LedgerConfig, UsageLedger
from costd.ledger.config import SQLITE
from costd.pipeline import PipelineError
from costd.reconcile.reconciler import DEFAULT_GRACE_S, Reconciler, Report
from llmmesh import redis_acl


async def reconcile(redis_url: str, ledger_config: LedgerConfig, since_s: float, repair: bool,
                    grace_s: float) -> Report:
    redis = aioredis.Redis.from_url(redis_acl.service_url(redis_url, "costd"), decode_responses=True, socket_connect_timeout=2.0)
    ledger = UsageLedger(ledger_config)
    await ledger.start()
    try:
        return await Reconciler(redis, ledger, grace_s).run(since_s, repair=repair)
    finally:
        await ledger.shutdown()
        await redis.aclose()


def _text(report: Report) -> str:
    lines = [f"{len(report.open_gaps)} gaps open, {report.num_repaired} repaired; "
             f"{report.num_matched} matched, {report.num_expired} expired"]
    lines += [f"{g.kind} {g.request_id} {g.tenant_id}: {g.detail}" for g in report.open_gaps]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m costd.reconcile", description=__doc__)
    parser.add_argument("--db", default=os.environ.get(LEDGER_URL_ENV, DEFAULT_LEDGER_URL))
    parser.add_argument("--redis-url", default=redis_acl.local_admin_url(),
                        help="default: REDIS_URL, else the admin URL `make up` left in "
                             "var/redis-users/admin.url")
    parser.add_argument("--since-s", type=float, default=3600.0)
    parser.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S,
                        help="leave out what ended this recently (it may be on its way)")
    parser.add_argument("--repair", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        config = LedgerConfig.from_url(args.db)
        if config.backend == SQLITE and not os.path.exists(config.path):
            # Opening would create an empty ledger, and every bill would look missing.
            raise ValueError(f"no ledger at {config.path}")
        if args.since_s <= 0 or args.grace_s < 0:
            raise ValueError("--since-s must be > 0 and --grace-s >= 0")
        report = asyncio.run(reconcile(args.redis_url, config, args.since_s, args.repair,
                                       args.grace_s))
    except (OSError, ValueError, RedisError, PipelineError) as error:
        print(f"reconcile: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict()) if args.json else _text(report))
    return 1 if report.open_gaps else 0


if __name__ == "__main__":
    sys.exit(main())
