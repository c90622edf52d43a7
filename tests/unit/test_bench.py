"""The bench harness on an in-process fake target: arrivals, stopping, percentiles, report, curve.

No server and no model run here (only the GGUF's tokenizer is read); speed is never judged.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest

from bench import loadgen, metrics, workload
from bench.curve import write_curve
from bench.profile import Slo, load_profile
from bench.report import write_report
from bench.runner import Options, run_bench
from bench.verdicts import verdicts
from llmmesh.models import resolve_model
from llmmesh.tokenizer import Tokenizer

PROFILE = """
description = "tiny"
duration_s = {duration}
max_requests = {max_requests}
seed = 5
rates = [1.0, 2.0]
drain_s = {drain}
alone = "chat"
[slo.interactive]
ttft_s = 1.0
tpot_s = 0.5
[slo.batch]
ttft_s = 5.0
tpot_s = 1.0
[[streams]]
name = "chat"
tenant = "acme"
request_class = "interactive"
rate_rps = 20.0
system_prompt_tokens = 32
prompt_tokens = [10, 20]
completion_tokens = [4, 8]
[[streams]]
name = "docs"
tenant = "globex"
request_class = "batch"
task = "summarise"
rate_rps = 5.0
prompt_tokens = [40, 60]
completion_tokens = [4, 8]
"""


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(resolve_model().gguf_path)


def _profile(tmp_path, duration=0.5, max_requests=1000, drain=5.0, scale=1.0):
    path = tmp_path / "tiny.toml"
    path.write_text(PROFILE.format(duration=duration, max_requests=max_requests, drain=drain))
    return load_profile(str(path), scale=scale)


class FakeTarget:
    """Streams `max_tokens` tokens a few ms apart; `hang` never finishes a request."""

    def __init__(self, name="mesh", step_s=0.002, hang=False):
        self.name, self.step_s, self.hang = name, step_s, hang
        self.in_flight = 0
        self.in_flight_at_start: list[int] = []   # per call, counting itself

    async def start(self):
        pass

    async def stream(self, spec):
        self.in_flight += 1
        self.in_flight_at_start.append(self.in_flight)
        try:
            if self.hang:
                await asyncio.Event().wait()
            for _ in range(spec.max_tokens):
                await asyncio.sleep(self.step_s)
                yield 1
            yield {"prompt_tokens": len(spec.prompt_token_ids), "cached_prompt_tokens": 16,
                   "completion_tokens": spec.max_tokens, "queue_s": 0.001,
                   "prefill_device_s": 0.01, "decode_device_s": 0.002 * spec.max_tokens}
        finally:
            self.in_flight -= 1

    async def load(self):
        return {"kv_usage": 0.25, "running": self.in_flight, "waiting": 0}

    async def bill(self, start, end, num_requests):
        return None

    def describe(self):
        return f"fake {self.name}"

    async def stop(self):
        pass


def test_same_seed_same_requests_and_the_alone_stream_keeps_its_arrivals(tmp_path, tok):
    profile = _profile(tmp_path)
    a, b = workload.open_loop(profile, tok, 0, 1.0), workload.open_loop(profile, tok, 0, 1.0)
    assert a == b and a
    assert [s.at_s for s in a] == sorted(s.at_s for s in a)
    assert all(0 <= s.at_s < profile.duration_s for s in a)
    alone = workload.open_loop(profile, tok, 0, 1.0, ("chat",))
    assert [s.at_s for s in alone] == [s.at_s for s in a if s.stream == "chat"]
    other_level = workload.open_loop(profile, tok, 1, 1.0)
    assert [s.prompt_token_ids for s in other_level] != [s.prompt_token_ids for s in a]


def test_prompt_lengths_follow_the_profile_after_the_shared_system_prompt(tmp_path, tok):
    profile = _profile(tmp_path)
    specs = [s for s in workload.open_loop(profile, tok, 0, 1.0) if s.stream == "chat"]
    system = {s.messages[0] for s in specs}
    assert len(system) == 1 and system.pop()[0] == "system"
    for s in specs:
        assert 4 <= s.max_tokens <= 8
        user_tokens = len(tok.encode(s.messages[1][1]))
        assert 10 <= user_tokens <= 20 + 12  # the ask's words come on top of the drawn filler


def test_count_bound_cuts_the_schedule(tmp_path, tok):
    profile = _profile(tmp_path, max_requests=3)
    assert len(workload.open_loop(profile, tok, 0, 2.0)) == 3


def test_open_loop_runs_every_request_and_stops_by_itself(tmp_path, tok):
    specs = workload.open_loop(_profile(tmp_path), tok, 0, 1.0)
    stats = asyncio.run(loadgen.run_open_loop(FakeTarget(), specs, drain_s=5.0))
    assert len(stats.outcomes) == len(specs) and all(o.ok for o in stats.outcomes)
    for o in stats.outcomes:
        assert o.sent_s >= o.spec.at_s - 1e-3
        assert o.sent_s <= o.first_token_s <= o.end_s
    assert stats.load_samples and stats.load_samples[0]["kv_usage"] == 0.25


def test_a_hung_target_is_cut_off_at_the_drain_bound(tmp_path, tok):
    specs = workload.open_loop(_profile(tmp_path, duration=0.2), tok, 0, 1.0)
    started = time.monotonic()
    stats = asyncio.run(loadgen.run_open_loop(FakeTarget(hang=True), specs, drain_s=0.3))
    assert time.monotonic() - started < 0.2 + 0.3 + 2.0
    assert {o.error for o in stats.outcomes} == {loadgen.DRAIN_TIMEOUT}


def test_closed_loop_never_exceeds_its_concurrency(tmp_path, tok):
    specs = workload.open_loop(_profile(tmp_path), tok, 0, 1.0)[:9]
    target, peak = FakeTarget(), [0]

    async def watch():
        while True:
            peak[0] = max(peak[0], target.in_flight)
            await asyncio.sleep(0.001)

    async def main():
        watcher = asyncio.create_task(watch())
        stats = await loadgen.run_closed_loop(target, specs, 3, timeout_s=10)
        watcher.cancel()
        return stats

    stats = asyncio.run(main())
    assert all(o.ok for o in stats.outcomes) and peak[0] == 3


def test_percentiles_are_ordered_and_exact_enough():
    d = metrics.dist([i / 1000 for i in range(1, 1001)])  # 1 ms .. 1 s
    assert d.n == 1000 and d.p50 <= d.p95 <= d.p99
    assert d.p50 == pytest.approx(0.5, rel=0.01) and d.p99 == pytest.approx(0.99, rel=0.01)
    assert metrics.dist([]) is None


def test_tenants_sharing_a_class_get_rows_of_their_own(tmp_path, tok):
    specs = workload.open_loop(_profile(tmp_path), tok, 0, 1.0)
    chat = [s for s in specs if s.stream == "chat"][:2]
    other_tenant = dataclasses.replace(chat[1], tenant="globex")
    outcomes = [loadgen.Outcome(chat[0]), loadgen.Outcome(other_tenant)]
    assert set(metrics.groups(outcomes)) == {"all", "interactive", "acme/interactive",
                                             "globex/interactive"}


def test_goodput_counts_only_requests_within_the_slo(tmp_path, tok):
    spec = workload.open_loop(_profile(tmp_path), tok, 0, 1.0)[0]
    fast = loadgen.Outcome(spec, 0.0, 0.1, 1.0, {"completion_tokens": 10})
    slow = loadgen.Outcome(spec, 0.0, 3.0, 4.0, {"completion_tokens": 10})
    failed = loadgen.Outcome(spec, error="UNAVAILABLE")
    slo = {spec.request_class: Slo(ttft_s=2.0, tpot_s=0.5)}
    s = metrics.summarise("all", [fast, slow, failed], wall_s=4.0, slo=slo)
    assert (s.num_ok, s.errors, s.goodput_rps) == (2, {"UNAVAILABLE": 1}, 0.25)
    assert s.slo_attainment == pytest.approx(1 / 3)


def test_full_run_writes_report_plots_and_verdicts(tmp_path, tok):
    profile = _profile(tmp_path)
    opts = Options(profile=profile, targets=("mesh", "worker"), progress=False, command="test",
                   settle_s=0.0)
    made = {}
    results = asyncio.run(run_bench(opts, make=lambda name, _: made.setdefault(name, FakeTarget(name))))
    # The warm-up's requests (up to 32: one per llama-server slot) go at once, before any level.
    num_warm = len(workload.warmup(profile, tok, opts.warmup_requests))
    assert opts.warmup_requests == 32 and num_warm > 2
    assert max(made["mesh"].in_flight_at_start[:num_warm]) == num_warm
    levels = results["targets"]["mesh"]["levels"]
    assert [lv["label"] for lv in levels] == ["chat alone ×1", "×1", "chat alone ×2", "×2"]
    # One tenant per class: tenant × class pairs would repeat the class rows.
    assert set(levels[1]["summaries"]) == {"all", "interactive", "batch"}
    lines = verdicts(results)
    assert any("Mesh overhead" in line for line in lines)
    assert any("mixed vs `chat` alone" in line for line in lines)
    report = write_report(results, tmp_path / "out", lines)
    text = report.read_text()
    assert "| mesh | ×2" in text and "![tiny-vs-load](tiny-vs-load.png)" in text
    for png in ("tiny-interactive-cdf.png", "tiny-batch-cdf.png", "tiny-vs-load.png"):
        assert (tmp_path / "out" / png).read_bytes()[:4] == b"\x89PNG"
    json.dumps(results, default=str)  # the results file must serialise


def test_closed_loop_profile_writes_a_curve_costd_can_read(tmp_path):
    from costd.whatif.curve import parse_curve
    profile = load_profile("curve", duration_s=10)
    loop = dataclasses.replace(profile.closed_loop, concurrency=(1, 2), requests_per_slot=1,
                               completion_tokens=4)
    profile = dataclasses.replace(profile, closed_loop=loop)
    opts = Options(profile=profile, targets=("worker",), progress=False, command="test",
                   settle_s=0.0)
    results = asyncio.run(run_bench(opts, make=lambda name, _: FakeTarget(name)))
    path = write_curve(results, tmp_path)
    curve = parse_curve(path.read_text(), path.stem)
    assert path.name == "cpu-smollm2.json" and [p.concurrency for p in curve.points] == [1, 2]
    assert curve.points[0].decode_tokens_per_s == pytest.approx(500.0)  # 1 token / 2 ms
    overhead = load_profile("overhead")  # closed loop too, but names no curve: writes none
    assert overhead.closed_loop.curve_name == ""


def test_diurnal_profile_follows_its_day_and_plots_it(tmp_path, tok):
    profile = load_profile("diurnal", scale=20.0, duration_s=2.4)  # 0.1 s per "hour"
    specs = workload.open_loop(profile, tok, 0, 1.0)
    night = [s for s in specs if s.at_s < 0.5]  # hours 0-4: rates 0.05-0.10 of the peak
    noon = [s for s in specs if 1.1 <= s.at_s < 1.6]  # hours 11-15: 0.8-1.0 of the peak
    assert len(noon) > 3 * max(1, len(night))
    opts = Options(profile=profile, targets=("mesh",), progress=False, command="test",
                   settle_s=0.0, warmup_requests=0)
    results = asyncio.run(run_bench(opts, make=lambda name, _: FakeTarget(name, step_s=0.0005)))
    write_report(results, tmp_path, verdicts(results))
    assert (tmp_path / "diurnal-day.png").read_bytes()[:4] == b"\x89PNG"


def test_a_target_that_fails_to_start_is_reported_and_the_others_still_run(tmp_path):
    class Broken(FakeTarget):
        async def start(self):
            raise RuntimeError("llama-server exited with 1")

    profile = _profile(tmp_path)
    opts = Options(profile=profile, targets=("llamacpp", "mesh"), progress=False,
                   command="test", settle_s=0.0, warmup_requests=0)
    make = lambda name, _: Broken(name) if name == "llamacpp" else FakeTarget(name)  # noqa: E731
    results = asyncio.run(run_bench(opts, make=make))
    assert results["targets"]["llamacpp"]["error"].endswith("exited with 1")
    assert len(results["targets"]["mesh"]["levels"]) == 4
    text = write_report(results, tmp_path / "out", verdicts(results)).read_text()
    assert "failed: RuntimeError: llama-server exited with 1" in text


def test_llama_server_stream_is_read_as_tokens_then_usage(tmp_path, tok):
    import httpx

    from bench.peers.llamacpp import parse_metrics
    from bench.targets import LlamaCppTarget, TargetError
    spec = workload.open_loop(_profile(tmp_path), tok, 0, 1.0)[0]
    seen = {}
    events = [{"choices": [{"text": "Hel"}]}, {"choices": [{"text": ""}]},
              {"choices": [{"text": "lo"}]},
              {"choices": [{"text": "", "finish_reason": "stop"}],
               "usage": {"prompt_tokens": 30, "completion_tokens": 3,
                         "prompt_tokens_details": {"cached_tokens": 16}}}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def handler(request):
        seen.update(json.loads(request.content))
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def run(status=200):
        target = LlamaCppTarget(str(tmp_path))
        target.client = httpx.AsyncClient(base_url="http://llama", transport=httpx.MockTransport(
            handler if status == 200 else lambda r: httpx.Response(status)))
        return [e async for e in target.stream(spec)]

    assert asyncio.run(run()) == [1, 1, {"prompt_tokens": 30, "cached_prompt_tokens": 16,
                                         "completion_tokens": 3}]
    assert seen["prompt"] == list(spec.prompt_token_ids) and seen["stream"] is True
    assert seen["max_tokens"] == spec.max_tokens and seen["temperature"] == 0.0
    with pytest.raises(TargetError, match="HTTP_503"):
        asyncio.run(run(503))
    assert parse_metrics("# HELP x\nllamacpp:requests_deferred 2\nother 1\n") == \
        {"requests_deferred": 2.0}


def test_overhead_report_judges_paired_differences_and_shows_the_hops_apart():
    from bench import overhead
    rows = [{"mesh": {"ttft_s": 0.100 + i * 1e-3, "tpot_s": 0.0081, "ttft_outside_engine_s": 0.004},
             "direct": {"ttft_s": 0.097 + i * 1e-3, "tpot_s": 0.0080, "ttft_outside_engine_s": 0.001}}
            for i in range(9)]
    summary = overhead.summarise(rows)
    assert summary["ttft_s"]["added_p50"] == pytest.approx(0.003)
    assert summary["tpot_s"]["added_p50"] == pytest.approx(0.0001)
    assert summary["ttft_outside_engine_s"]["added_p50"] == pytest.approx(0.003)
    env = {"machine": "test box", "load_average_at_start": [0, 0, 0], "commit": "abc"}
    text = overhead.report({"summary": summary, "describe": "mesh"}, "python -m bench.overhead", env)
    assert "| TTFT | 104.0 | 101.0 | +3.00 |" in text and "≤ 5 ✅" in text
    assert "| time per output token | 8.1 | 8.0 | +0.10 |" in text and "≤ 0.5 ✅" in text
    assert "| TTFT outside the engine |" in text and "(diagnostic)" in text
    # Older runs without usage in their rows still summarise (no diagnostic row).
    for r in rows:
        del r["mesh"]["ttft_outside_engine_s"]
    assert "ttft_outside_engine_s" not in overhead.summarise(rows)


def test_fronts_summary_compares_the_doors_it_is_told():
    from bench import fronts
    rows = [{"grpc": {"ttft_s": 0.003 + i * 1e-4, "delivery_s": 0.001},
             "http": {"ttft_s": 0.002 + i * 1e-4, "delivery_s": 0.0009},
             "httpx": {"ttft_s": 0.004 + i * 1e-4, "delivery_s": 0.0011},
             "grpc_nometrics": {"ttft_s": 0.0029 + i * 1e-4, "delivery_s": 0.001}} for i in range(9)]
    assert fronts.summarise(rows)["ttft_s"]["added_p50"] == pytest.approx(-0.001)
    m = fronts.summarise(rows, "grpc", "grpc_nometrics")["ttft_s"]
    assert m["added_p50"] == pytest.approx(0.0001)
    assert m["http_p50"] == pytest.approx(0.0034) and m["grpc_p50"] == pytest.approx(0.0033)
