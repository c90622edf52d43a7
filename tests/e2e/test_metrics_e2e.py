"""Metrics on the real mesh, scraped by a real Prometheus (Debian's package): PromQL through its
HTTP API agrees with what the clients measured — request and token counts exact, the p95 of TTFT
within a bucket of the clients' p95 — and every service's own families are there."""
from __future__ import annotations

import bisect
import json
import os
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from gateway.tenants import hash_key
from llmmesh.launcher import free_port
from llmmesh.metrics import TTFT_BUCKETS
from llmmesh.v1 import gateway_pb2_grpc
from tests.e2e.meshkit import DEMO_KEYS, auth, chat, mesh_with_tenants, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.model,
              pytest.mark.skipif(shutil.which("prometheus") is None,
                                 reason="prometheus missing: sudo apt-get install -y prometheus "
                                        "(scripts/setup.sh does it as root)")]
MODEL = "smollm2-135m-instruct"


DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "llmmesh.json"
# The demo tenants, globex with a monthly token budget (the budget-rate gauge and its panel).
TENANTS = f"""
[tenants.acme]
api_key_sha256 = ["{hash_key(DEMO_KEYS['acme'])}"]
[tenants.globex]
api_key_sha256 = ["{hash_key(DEMO_KEYS['globex'])}"]
token_budget = 2592000
budget_period = "month"
"""


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with mesh_with_tenants(tmp_path_factory.mktemp("metrics"), TENANTS) as m:
        yield m


@pytest.fixture(scope="module")
def prometheus(mesh, tmp_path_factory):
    directory = tmp_path_factory.mktemp("prometheus")
    jobs = "\n".join(f"  - job_name: {name}\n    static_configs: [{{targets: ['{p.metrics_address}']}}]"
                     for name, p in mesh.procs.items() if p.metrics_address)
    (directory / "prometheus.yml").write_text(
        f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n{jobs}\n")
    address = f"127.0.0.1:{free_port()}"
    log = open(directory / "prometheus.log", "wb")
    proc = subprocess.Popen(["prometheus", f"--config.file={directory / 'prometheus.yml'}",
                             f"--storage.tsdb.path={directory / 'data'}",
                             f"--web.listen-address={address}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://{address}"
        wait_until(lambda: _ready(url), 30, interval_s=0.2, what="prometheus ready")
        yield url
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def query(url: str, promql: str) -> list[dict]:
    reply = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5).json()
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def scalar(url: str, promql: str) -> float | None:
    result = query(url, promql)
    return float(result[0]["value"][1]) if result else None


def test_promql_agrees_with_what_the_clients_measured(mesh, prometheus):
    wait_until(lambda: scalar(prometheus, 'count(up == 1)') == len(
        [p for p in mesh.procs.values() if p.metrics_address]), 30, what="every target up")
    ttfts, tokens = [], {"acme": 0, "globex": 0}
    with grpc.insecure_channel(mesh.procs["gateway"].address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for i in range(10):
            sent, first = time.monotonic(), None
            for msg in stub.Generate(chat(f"Name a colour, please ({i}).", 8), metadata=auth(DEMO_KEYS["acme"]),
                                     timeout=120):
                if msg.HasField("chunk") and msg.chunk.token_ids and first is None:
                    first = time.monotonic()
                if msg.HasField("final"):
                    tokens["acme"] += msg.final.usage.completion_tokens
            ttfts.append(first - sent)
    client = openai.OpenAI(base_url=mesh.openai_base_url, api_key=DEMO_KEYS["globex"], max_retries=0)
    for i in range(4):
        r = client.chat.completions.create(model=MODEL, max_tokens=6, service_tier="flex",
                                           messages=[{"role": "user", "content": f"Say {i}."}])
        tokens["globex"] += r.usage.completion_tokens
    with pytest.raises(openai.AuthenticationError):   # never a tenant label
        openai.OpenAI(base_url=mesh.openai_base_url, api_key="not-a-key", max_retries=0
                      ).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])

    total = "sum(gen_ai_server_request_duration_seconds_count)"
    wait_until(lambda: scalar(prometheus, total) == 14, 30, what="14 requests scraped")
    by_tenant = {(r["metric"]["tenant"], r["metric"]["class"]): float(r["value"][1]) for r in query(
        prometheus, "sum by (tenant, class) (gen_ai_server_request_duration_seconds_count)")}
    assert by_tenant == {("acme", "interactive"): 10, ("globex", "batch"): 4}
    out = {r["metric"]["tenant"]: float(r["value"][1]) for r in query(
        prometheus, 'sum by (tenant) (gen_ai_client_token_usage_sum{gen_ai_token_type="output"})')}
    assert out == tokens
    ops = {r["metric"]["gen_ai_operation_name"] for r in query(
        prometheus, "gen_ai_server_time_to_first_token_seconds_count")}
    assert ops == {"chat"}

    # The p95 of TTFT from the histogram lands within one bucket of the clients' own p95.
    p95 = scalar(prometheus, 'histogram_quantile(0.95, sum by (le) '
                             '(gen_ai_server_time_to_first_token_seconds_bucket{class="interactive"}))')
    client_p95 = statistics.quantiles(ttfts, n=20)[-1]
    assert abs(bisect.bisect_left(TTFT_BUCKETS, p95) - bisect.bisect_left(TTFT_BUCKETS, client_p95)) <= 1, \
        (p95, client_p95)

    # Router, worker and costd agree on the same 14 − 0 refused: 14 requests ended, 14 bills.
    wait_until(lambda: scalar(prometheus, 'sum(llmmesh_router_requests_total{outcome="ok"})') == 14,
               20, what="router outcomes")
    wait_until(lambda: scalar(prometheus, 'sum(llmmesh_costd_usage_records_total{outcome="billed"})') == 14,
               20, what="costd's billed records")
    assert scalar(prometheus, 'sum(llmmesh_costd_usage_records_total{outcome="duplicate"})') == 0
    assert scalar(prometheus, 'sum(llmmesh_admissions_total{outcome="admitted"})') == 14
    assert scalar(prometheus, 'sum(llmmesh_dispatch_latency_seconds_count)') == 14
    assert scalar(prometheus, 'llmmesh_worker_healthy{worker="worker0"}') == 1
    assert scalar(prometheus, 'llmmesh_worker_circuit_state{worker="worker0",state="closed"}') == 1
    assert scalar(prometheus, 'sum(llmmesh_prefix_cache_queries_total)') > \
        scalar(prometheus, 'sum(llmmesh_prefix_cache_hits_total)') > 0
    assert scalar(prometheus, 'sum(llmmesh_engine_tokens_per_step_sum)') >= sum(tokens.values())
    # Sampled each second and scraped each second: the last entry's deletion shows within ~2 s.
    wait_until(lambda: scalar(prometheus, 'max(llmmesh_queue_depth)') == 0, 10,
               what="empty queues in the router's sample")

    # Money per tenant: the attributed device time at the price book's price, billed once.
    cost = {r["metric"]["tenant"]: float(r["value"][1]) for r in query(
        prometheus, "sum by (tenant) (llmmesh_costd_attributed_cost_total)")}
    assert set(cost) == {"acme", "globex"} and all(v > 0 for v in cost.values())
    from costd.pricebook import PriceBook
    import sqlite3
    book = PriceBook.load(str(Path(__file__).resolve().parents[2] / "config" / "prices.toml"))
    conn = sqlite3.connect(f"{mesh.var_dir}/ledger.sqlite")
    rows = conn.execute("SELECT tenant_id, device_type, end_unix_ns, prefill_device_s + decode_device_s "
                        "FROM usage_records").fetchall()
    conn.close()
    expected = {}
    for tenant, device_type, end_ns, seconds in rows:
        price = book.price(book.device_for(device_type), end_ns).per_hour
        expected[tenant] = expected.get(tenant, 0.0) + float(price) * seconds / 3600
    assert cost == pytest.approx(expected, rel=1e-6)
    # 2,592,000 tokens a month is 1 token/s on average.
    assert scalar(prometheus, 'llmmesh_tenant_token_budget_rate{tenant="globex"}') == 1.0
    assert scalar(prometheus, 'llmmesh_tenant_token_budget_rate{tenant="acme"}') == 0.0


def test_every_dashboard_panel_returns_data(mesh, prometheus):
    """Runs after the traffic above (same module): each panel's PromQL, as Grafana would send it
    with a 1m rate interval, has data in the real Prometheus."""
    dashboard = json.loads(DASHBOARD.read_text())
    empty = []
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "1m")
            # A few tries: an instant gauge is briefly stale after one late scrape (1 s
            # interval, 1 s timeout, on a loaded 2-core host), which is no fault of the panel.
            deadline = time.monotonic() + 10
            while not query(prometheus, expr):
                if time.monotonic() > deadline:
                    empty.append(f"{panel['title']}: {expr}")
                    break
                time.sleep(0.5)
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_llmmesh_top_shows_workers_queues_tenants_and_billing(mesh):
    """One frame of `llmmesh top --once`, after the traffic above, from the services' metrics."""
    import subprocess as sp
    import sys
    mesh.write_metrics_targets()
    out = sp.run([sys.executable, "-m", "llmmesh.cli", "top", "--once", "--var-dir", mesh.var_dir],
                 capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    worker = next(line for line in lines if "worker0" in line)
    assert "yes" in worker and "closed" in worker
    acme = next(line for line in lines if "acme" in line and "interactive" in line)
    assert " 10 " in acme          # the ten requests of the first test
    globex = next(line for line in lines if "globex" in line and "batch" in line)
    assert " 4 " in globex
    assert any("interactive" in line and "dispatched" not in line for line in lines)
    billing = lines[next(i for i, line in enumerate(lines) if "billed records" in line) + 2]
    assert billing.split()[1] == "14"
