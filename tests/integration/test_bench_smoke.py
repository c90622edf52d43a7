"""`llmmesh bench` end to end at a tiny scale: a real mesh (redis, costd, worker on the real
model, router, gateway), two tenants and two classes, a few requests. Checks that the run stops
by itself, the report and plots are written, percentiles are sane and costd priced the run.
Speed is not judged: this machine may be busy.
"""
from __future__ import annotations

import asyncio

import pytest

from bench import workload
from bench.profile import load_profile
from bench.report import write_report
from bench.runner import Options, plan_levels, run_bench
from bench.verdicts import verdicts
from llmmesh.models import resolve_model
from llmmesh.tokenizer import Tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.model]

PROFILE = """
description = "smoke: two tenants, two classes, a handful of short requests"
duration_s = 3
max_requests = 4
seed = 3
rates = [1.0]
drain_s = 120
[slo.interactive]
ttft_s = 1.0
tpot_s = 0.25
[slo.batch]
ttft_s = 30.0
tpot_s = 1.0
[[streams]]
name = "chat"
tenant = "acme"
request_class = "interactive"
rate_rps = 0.7
system_prompt_tokens = 32
prompt_tokens = [10, 20]
completion_tokens = [4, 6]
[[streams]]
name = "docs"
tenant = "globex"
request_class = "batch"
task = "summarise"
rate_rps = 0.4
prompt_tokens = [40, 60]
completion_tokens = [4, 6]
"""


def test_tiny_bench_against_a_real_mesh(tmp_path):
    path = tmp_path / "smoke.toml"
    path.write_text(PROFILE)
    profile = load_profile(str(path))
    tok = Tokenizer.from_gguf(resolve_model().gguf_path)
    specs = plan_levels(profile, tok)[0].specs
    assert 1 <= len(specs) <= 4, "the seed should draw a few arrivals in 3 s"
    opts = Options(profile=profile, targets=("mesh",), var_dir=str(tmp_path / "var"),
                   progress=False, command="pytest smoke", warmup_requests=1)

    results = asyncio.run(run_bench(opts))  # returns only once every request ended

    level = results["targets"]["mesh"]["levels"][0]
    whole = level["summaries"]["all"]
    assert whole["num_ok"] == whole["num_requests"] == len(specs), whole["errors"]
    # The gateway's chat template and tokenizer saw the same prompts the bench drew.
    assert whole["prompt_tokens"] == sum(len(s.prompt_token_ids) for s in specs)
    assert 0 < whole["completion_tokens"] <= sum(s.max_tokens for s in specs)
    for metric in ("ttft", "e2e"):
        d = whole[metric]
        assert 0 < d["p50"] <= d["p95"] <= d["p99"]
    assert whole["ttft"]["p50"] <= whole["e2e"]["p99"]
    for request_class, _tenant, ttft, _tpot, e2e, tokens, error, *_ in level["requests"]:
        assert not error and 0 < ttft <= e2e and tokens >= 1
    assert "kv_usage" in level["load"]
    costd = level["cost"]["costd"]
    assert costd["requests_billed"] == len(specs) and costd["per_1m"] > 0

    report = write_report(results, tmp_path / "out", verdicts(results))
    assert "| mesh |" in report.read_text()
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert pngs and all((tmp_path / "out" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
    assert workload.offered_rps(profile, 1.0) == pytest.approx(1.1)


def test_fronts_bench_measures_both_doors_token_for_token(tmp_path):
    """bench.fronts at a tiny scale: the real gateway's two doors against its fake engine; every
    token written is received on each door, and the report judges the minimal-client row."""
    from bench import fronts
    result = asyncio.run(fronts.measure(rounds=8, tokens=6, pace_s=0.002, var_dir=str(tmp_path)))
    assert len(result["rows"]) == 8
    for row in result["rows"]:
        for door in ("grpc", "http", "httpx", "grpc_nometrics"):
            assert 0 < row[door]["ttft_s"] < 5 and 0 < row[door]["delivery_s"] < 1
    text = "\n".join(fronts.report_lines(result))
    assert text.count("✅") + text.count("❌") == 3 and text.count("(context)") == 3
