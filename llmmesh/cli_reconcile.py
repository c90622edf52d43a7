"""`llmmesh reconcile`: settled admissions and billing records in Redis against the ledger.

Runs `python -m costd.reconcile` here (as `llmmesh whatif --local` runs costd.whatif): it needs
Redis and the ledger, not costd, so it answers — and repairs — while costd is down, which is
when bills wait; no service is imported here. Exit status: 0 no gap left open, 1 gaps left
open, 2 it could not run.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import typer

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds_of(text: str) -> float:
    """'90s', '30m', '1h', '2d' or a bare number of seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not match:
        raise typer.BadParameter(f"{text!r}: want a duration like 90s, 30m, 1h or 2d")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def _when(unix_ms: int) -> str:
    if not unix_ms:
        return "-"
    return datetime.fromtimestamp(unix_ms / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def print_report(report: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 140)
    kept = (f"from {_when(report['horizon_unix_ms'])} on" if report["horizon_unix_ms"]
            else "all (none dropped yet)")
    console.print(f"window {_when(report['start_unix_ms'])} .. {_when(report['end_unix_ms'])} "
                  f"UTC; billing records Redis keeps: {kept}")
    console.print(f"settled {report['num_settled']}, records {report['num_records']}, ledger "
                  f"rows {report['num_ledger_rows']}: matched {report['num_matched']}, expired "
                  f"{report['num_expired']}, repaired {report['num_repaired']}, open gaps "
                  f"{report['num_open_gaps']}")
    if not report["gaps"]:
        return
    table = Table(box=box.SIMPLE_HEAD)
    for column in ("gap", "tenant", "request", "redis tokens", "ledger tokens", "state",
                   "detail"):
        table.add_column(column, justify="right" if "tokens" in column else "left")
    for g in report["gaps"]:
        state = ("repaired" if g["repaired"] else
                 "repairable" if g["repairable"] else "open")
        table.add_row(g["kind"], g["tenant_id"], g["request_id"],
                      "-" if g["redis_tokens"] is None else str(g["redis_tokens"]),
                      "-" if g["ledger_tokens"] is None else str(g["ledger_tokens"]),
                      state, g["detail"])
    console.print(table)
    repairable = sum(g["repairable"] and not g["repaired"] for g in report["gaps"])
    if repairable:
        console.print(f"{repairable} can be billed from their records: run again with --repair")


def reconcile(since: str = typer.Option("1h", help="window: from this long ago until now"),
              repair: bool = typer.Option(False, "--repair",
                                          help="bill what the ledger lacks while its record "
                                               "is still in Redis (never twice)"),
              as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
              db: str = typer.Option("", help="ledger URL (default: LLMMESH_LEDGER_URL, else "
                                              "costd's default)"),
              redis_url: str = typer.Option("", help="Redis URL (default: REDIS_URL)"),
              grace: str = typer.Option("60s", help="leave out what ended this recently")) -> None:
    """Compare what Redis says was billed with the ledger; exit 1 while gaps remain."""
    flags = ["--since-s", str(seconds_of(since)), "--grace-s", str(seconds_of(grace)), "--json"]
    flags += ["--db", db] if db else []
    flags += ["--redis-url", redis_url] if redis_url else []
    flags += ["--repair"] if repair else []
    # In the caller's directory, so a relative --db means what was typed.
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                      env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "costd.reconcile", *flags], capture_output=True,
                          env=env)
    if done.returncode not in (0, 1):
        typer.echo(done.stderr.decode().strip() or f"reconcile exited {done.returncode}", err=True)
        raise typer.Exit(2)
    report = json.loads(done.stdout)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_report(report)
    raise typer.Exit(1 if report["num_open_gaps"] else 0)


def register(app: typer.Typer) -> None:
    app.command("reconcile")(reconcile)
