"""`llmmesh top`: a live terminal view of the mesh from its services' metrics — workers, queues,
tenants, billing — what an operator opens first. Reads each service's /metrics directly (the
addresses `llmmesh up` writes to <var>/metrics-targets.json, or --targets), so it needs no
Prometheus."""
from __future__ import annotations

import json
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import typer
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

TARGETS_FILE = "metrics-targets.json"


def read_targets(var_dir: str, targets: str) -> dict[str, str]:
    if targets:
        return dict(t.split("=", 1) if "=" in t else (t, t) for t in targets.split(","))
    path = Path(var_dir) / TARGETS_FILE
    if not path.exists():
        raise typer.BadParameter(f"{path} not found: run `llmmesh up`, or pass --targets "
                                 "name=host:port,...", param_hint="--targets")
    return json.loads(path.read_text())


def scrape(targets: dict[str, str], timeout_s: float = 2.0) -> tuple[list[tuple], list[str]]:
    """Every sample of every target as (target, name, labels, value); and the targets down."""
    samples, down = [], []
    for name, address in targets.items():
        try:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as r:
                text = r.read().decode()
        except OSError:
            down.append(name)
            continue
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.append((name, s.name, s.labels, s.value))
    return samples, down


def _quantile(buckets: dict[float, float], q: float) -> float | None:
    """A quantile from cumulative histogram buckets (upper bound of the bucket it falls in)."""
    if not buckets:
        return None
    total = max(buckets.values())
    if total <= 0:
        return None
    for le in sorted(buckets):
        if buckets[le] >= q * total:
            return le
    return None


def render(samples: list[tuple], down: list[str]) -> Group:
    by_name = defaultdict(list)
    for target, name, labels, value in samples:
        by_name[name].append((target, labels, value))

    def one(name: str, **match) -> dict[str, float]:
        out = {}
        for _, labels, value in by_name.get(name, ()):
            if all(labels.get(k) == v for k, v in match.items()):
                out[labels.get("worker") or labels.get("class") or labels.get("tenant") or ""] = value
        return out

    workers = Table(title="workers", expand=True)
    for col in ("worker", "healthy", "circuit", "running", "waiting", "KV used", "prefix hits",
                "steps", "step p50"):
        workers.add_column(col, justify="right" if col != "worker" else "left")
    running, waiting, kv = one("llmmesh_requests_running"), one("llmmesh_requests_waiting"), \
        one("llmmesh_kv_cache_usage_ratio")
    healthy = one("llmmesh_worker_healthy")
    queries, hits = one("llmmesh_prefix_cache_queries_total"), one("llmmesh_prefix_cache_hits_total")
    steps = one("llmmesh_engine_step_seconds_count")
    circuit = {}
    for _, labels, value in by_name.get("llmmesh_worker_circuit_state", ()):
        if value:
            circuit[labels["worker"]] = labels["state"]
    step_buckets = defaultdict(dict)
    for _, labels, value in by_name.get("llmmesh_engine_step_seconds_bucket", ()):
        step_buckets[labels["worker"]][float(labels["le"])] = value
    for w in sorted(set(running) | set(healthy)):
        p50 = _quantile(step_buckets.get(w, {}), 0.5)
        workers.add_row(w, "yes" if healthy.get(w, 1) else "[red]no[/]", circuit.get(w, "–"),
                        f"{running.get(w, 0):.0f}", f"{waiting.get(w, 0):.0f}",
                        f"{kv.get(w, 0):.0%}",
                        f"{hits.get(w, 0) / queries[w]:.0%}" if queries.get(w) else "–",
                        f"{steps.get(w, 0):.0f}", f"≤{p50 * 1e3:g} ms" if p50 else "–")

    queues = Table(title="queues", expand=True)
    for col in ("class", "depth", "unread (lag)", "pending", "oldest", "dispatched"):
        queues.add_column(col, justify="right" if col != "class" else "left")
    depth, lag = one("llmmesh_queue_depth"), one("llmmesh_queue_lag")
    pending, oldest = one("llmmesh_queue_pending"), one("llmmesh_queue_oldest_age_seconds")
    dispatched = one("llmmesh_dispatch_latency_seconds_count")
    for c in sorted(set(depth) | set(dispatched)):
        queues.add_row(c, f"{depth.get(c, 0):.0f}", f"{lag.get(c, 0):.0f}", f"{pending.get(c, 0):.0f}",
                       f"{oldest.get(c, 0):.1f} s", f"{dispatched.get(c, 0):.0f}")

    tenants = Table(title="tenants", expand=True)
    for col in ("tenant", "class", "requests", "errors", "prompt tokens", "completion tokens",
                "TTFT p95"):
        tenants.add_column(col, justify="right" if col not in ("tenant", "class") else "left")
    rows = defaultdict(lambda: {"requests": 0.0, "errors": 0.0, "input": 0.0, "output": 0.0,
                                "ttft": defaultdict(float)})
    for _, labels, value in by_name.get("gen_ai_server_request_duration_seconds_count", ()):
        key = (labels["tenant"], labels["class"])
        rows[key]["requests"] += value
        if labels.get("error_type"):
            rows[key]["errors"] += value
    for _, labels, value in by_name.get("gen_ai_client_token_usage_sum", ()):
        rows[(labels["tenant"], labels["class"])][labels["gen_ai_token_type"]] += value
    for _, labels, value in by_name.get("gen_ai_server_time_to_first_token_seconds_bucket", ()):
        rows[(labels["tenant"], labels["class"])]["ttft"][float(labels["le"])] += value
    for (tenant, cls), r in sorted(rows.items()):
        p95 = _quantile(r["ttft"], 0.95)
        tenants.add_row(tenant, cls, f"{r['requests']:.0f}", f"{r['errors']:.0f}", f"{r['input']:.0f}",
                        f"{r['output']:.0f}", f"≤{p95 * 1e3:g} ms" if p95 else "–")

    billing = Table(title="billing (costd)", expand=True)
    for col in ("billed records", "duplicates", "spans rejected", "ledger lag"):
        billing.add_column(col, justify="right")
    rejected = sum(v for _, _, v in by_name.get("llmmesh_costd_spans_rejected_total", ()))
    lag_s = next((v for _, _, v in by_name.get("llmmesh_costd_ledger_lag_seconds", ())), None)
    billing.add_row(f"{_by_outcome(by_name, 'billed'):.0f}", f"{_by_outcome(by_name, 'duplicate'):.0f}",
                    f"{rejected:.0f}", f"{lag_s:.1f} s" if lag_s is not None else "–")
    parts = [workers, queues, tenants, billing]
    if down:
        parts.insert(0, f"[red]not answering: {', '.join(down)}[/]")
    return Group(*parts)


def _by_outcome(by_name, outcome: str) -> float:
    return sum(v for _, labels, v in by_name.get("llmmesh_costd_usage_records_total", ())
               if labels.get("outcome") == outcome)


def top(var_dir: str = typer.Option("var", help="where `llmmesh up` wrote metrics-targets.json"),
        targets: str = typer.Option("", help="name=host:port,... instead of the file"),
        interval: float = typer.Option(2.0, help="seconds between refreshes"),
        once: bool = typer.Option(False, "--once", help="print one frame and exit")) -> None:
    """A live view of workers, queues, tenants and billing, from the services' metrics."""
    found = read_targets(var_dir, targets)
    console = Console()
    if once:
        console.print(render(*scrape(found)))
        return
    with Live(render(*scrape(found)), console=console, refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(render(*scrape(found)))
        except KeyboardInterrupt:
            pass


def register(app: typer.Typer) -> None:
    app.command("top")(top)
