"""The two llama.cpp builds (native, noamx): which are timed on which CPU, the best build kept
per cell of the engine bench, the build llama-server runs from, and the build script's variants.

Nothing is compiled and no model runs: llama.cpp's tools are fakes that answer by build.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest

from bench.engine import peers
from bench.engine import report
from bench.peers import llamacpp
from bench.peers.llamacpp import (VARIANTS, Builds, LlamaServer, choose_server_build,
                                  llamacpp_builds, pick_server_build)

AMX_CPU = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni amx_bf16 amx_tile amx_int8\n"
AVX2_CPU = "processor\t: 0\nflags\t\t: fpu avx avx2 fma\nbugs\t\t: sysret_ss_attrs\n"


def test_both_builds_are_timed_only_where_the_cpu_has_amx():
    assert llamacpp_builds(AMX_CPU, env={}).variants == VARIANTS
    only = llamacpp_builds(AVX2_CPU, env={})
    assert only.variants == ("native",)
    assert "no AMX" in only.reason and "same code" in only.reason


def test_the_variants_env_forces_both_builds_and_refuses_unknown_ones():
    forced = llamacpp_builds(AVX2_CPU, env={"LLAMA_CPP_VARIANTS": "native, noamx"})
    assert forced.variants == ("native", "noamx") and "LLAMA_CPP_VARIANTS" in forced.reason
    with pytest.raises(ValueError, match="avx9"):
        llamacpp_builds(AVX2_CPU, env={"LLAMA_CPP_VARIANTS": "native,avx9"})


def test_a_prebuilt_copy_is_the_one_build_even_on_an_amx_cpu():
    builds = llamacpp_builds(AMX_CPU, env={"LLAMA_CPP_BIN_DIR": "/opt/llama"})
    assert builds.variants == ("native",) and "LLAMA_CPP_BIN_DIR" in builds.reason


def _fake_bin(name: str, variant: str = "native") -> str:
    return f"/fake/{variant}/{name}"


# tok/s each fake tool reports, by build and OMP_WAIT_POLICY ("PASSIVE" or "spin").
SPEEDS = {
    ("native", "PASSIVE"): {"pp": 300.0, "tg": 120.0, "speed_pp": 280.0, "speed_tg": 200.0},
    ("native", "spin"): {"pp": 290.0, "tg": 125.0, "speed_pp": 260.0, "speed_tg": 150.0},
    ("noamx", "PASSIVE"): {"pp": 350.0, "tg": 110.0, "speed_pp": 330.0, "speed_tg": 190.0},
    ("noamx", "spin"): {"pp": 340.0, "tg": 118.0, "speed_pp": 320.0, "speed_tg": 195.0},
}


@pytest.fixture
def fake_tools(monkeypatch):
    """llama.cpp's tools as fakes; native's llama-batched-bench crashes with repacking on (as
    the AMX backend did). Returns the calls, one (build, policy, argv) each."""
    calls = []

    def run_json(argv, timeout_s, env=None):
        variant, tool = argv[0].split("/")[2:4]
        policy = env.get("OMP_WAIT_POLICY", "spin")
        calls.append((variant, policy, argv))
        speed = SPEEDS[variant, policy]
        if tool == "llama-bench":
            prompt = argv[argv.index("-p") + 1] != "0"
            return json.dumps([{"n_gen": 0 if prompt else 16,
                                "avg_ts": speed["pp" if prompt else "tg"]}])
        if variant == "native" and "--no-repack" not in argv:
            raise subprocess.CalledProcessError(-11, argv)
        return ("main: log line\n" + json.dumps(
            {"pl": 8, "pp": 128, "tg": 16, "speed_pp": speed["speed_pp"],
             "speed_tg": speed["speed_tg"], "t": 8 * 16 / speed["speed_tg"]}) + "\n")

    monkeypatch.setattr(peers, "llamacpp_bin", _fake_bin)
    monkeypatch.setattr(llamacpp, "llamacpp_bin", _fake_bin)
    monkeypatch.setattr(peers, "_run_json", run_json)
    return calls


def test_every_build_is_timed_and_each_cell_keeps_its_best_build(fake_tools):
    result = peers.llamacpp("m.gguf", 2, [1, 8], 128, 16, repeats=1,
                            builds=Builds(VARIANTS, "both, for the test"))
    assert {(v, p) for v, p, _ in fake_tools} == set(SPEEDS)
    assert result.prefill_tps == {1: 350.0, 8: 330.0}
    assert result.decode_tps == {1: 125.0, 8: 200.0}
    winners = {(cell, n): peers.winning_build(result, cell, n)
               for cell in ("prefill_tps", "decode_tps") for n in (1, 8)}
    assert winners == {("prefill_tps", 1): "noamx", ("prefill_tps", 8): "noamx",
                       ("decode_tps", 1): "native", ("decode_tps", 8): "native"}
    assert peers.winning_build(result, "e2e_tps", 8) == "native"
    assert peers.winning_build(result, "e2e_tps", 1) is None   # never timed @1
    # The fallback is the crashing build's alone, and named.
    assert "native build: llama-batched-bench: exit -11" in result.note
    assert "noamx build:" not in result.note and "both, for the test" in result.note


def test_one_build_is_timed_alone_and_its_fallback_is_not_labelled(fake_tools):
    result = peers.llamacpp("m.gguf", 2, [1, 8], 128, 16, repeats=1,
                            builds=Builds(("native",), "native only"))
    assert {v for v, _, _ in fake_tools} == {"native"}
    assert result.prefill_tps == {1: 300.0, 8: 280.0} and list(result.builds) == ["native"]
    assert "; llama-batched-bench: exit -11" in result.note and "native build:" not in result.note


def test_a_tie_goes_to_the_native_build_and_the_table_names_each_cell():
    native = peers.PeerResult("native", prefill_tps={1: 300.0, 8: 280.0}, decode_tps={1: 120.0})
    noamx = peers.PeerResult("noamx", prefill_tps={1: 300.0, 8: 330.0}, decode_tps={1: 110.0})
    best = peers.best_per_cell("llama.cpp", {"native": native, "noamx": noamx})
    assert peers.winning_build(best, "prefill_tps", 1) == "native"
    rows = report.build_table(best, [1, 8])
    assert rows[0] == "| cell | native | noamx | kept |"
    assert "| prefill @1 | 300 | 300 | native |" in rows
    assert "| prefill @8 | 280 | 330 | noamx |" in rows
    assert "| decode @1 | 120.0 | 110.0 | native |" in rows
    assert not any(r.startswith("| decode @8") or r.startswith("| end-to-end") for r in rows)
    assert report._builds(best, [1, 8])[1].startswith("## llama.cpp: the build behind each cell")
    alone = peers.best_per_cell("llama.cpp", {"native": native})
    assert report._builds(alone, [1, 8]) == [
        "", "llama.cpp: every cell from its native build (why only one: Notes)."]


def test_llama_server_runs_the_faster_build_and_a_crashed_one_never():
    assert pick_server_build({"native": 500.0, "noamx": 400.0}).variant == "native"
    crashed = pick_server_build({"native": None, "noamx": 400.0})
    assert crashed.variant == "noamx" and "native failed" in crashed.reason
    assert "noamx 400 tok/s" in crashed.reason
    none = pick_server_build({"native": None, "noamx": None})
    assert none.variant == "native" and none.reason.startswith("every build failed")


def test_llama_server_probes_only_where_there_are_two_builds(monkeypatch):
    probed = []
    monkeypatch.setattr(llamacpp, "probe_tps",
                        lambda v, *_: probed.append(v) or {"native": 90.0, "noamx": 95.0}[v])
    one = choose_server_build("m.gguf", 0, Builds(("native",), "native only: no AMX"))
    assert one.variant == "native" and one.reason == "native only: no AMX" and probed == []
    two = choose_server_build("m.gguf", 0, Builds(VARIANTS, "AMX"))
    assert two.variant == "noamx" and probed == ["native", "noamx"]


def test_llama_server_starts_the_binary_of_its_build(monkeypatch):
    monkeypatch.setattr(llamacpp, "llamacpp_bin", _fake_bin)
    assert LlamaServer("m.gguf", 1234).argv()[0] == "/fake/native/llama-server"
    assert LlamaServer("m.gguf", 1234, variant="noamx").argv()[0] == "/fake/noamx/llama-server"


@pytest.fixture
def fake_cmake(tmp_path):
    """A build root with the source already unpacked and a `cmake` that logs each configure's
    arguments and each build, making the three binaries instead of compiling them."""
    (tmp_path / "root/llama_cpp_python-0.3.36/vendor/llama.cpp").mkdir(parents=True)
    (tmp_path / "tools").mkdir()
    cmake = tmp_path / "tools/cmake"
    cmake.write_text(f"""#!/usr/bin/env bash
if [ "$1" = --build ]; then
  mkdir -p "$2/bin"
  for t in {' '.join(llamacpp.TOOLS)}; do : > "$2/bin/$t"; chmod +x "$2/bin/$t"; done
  echo "$2" >> {tmp_path}/builds.log
else  # -S . -B <dir> ...
  printf '%s\\n' "$@" > {tmp_path}/configure-$4.args
fi
""")
    cmake.chmod(cmake.stat().st_mode | stat.S_IEXEC)

    def build(*variant: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "LLMMESH_BENCH_BUILD": str(tmp_path / "root"),
               "PATH": f"{tmp_path / 'tools'}:{os.environ['PATH']}"}
        return subprocess.run(["bash", str(llamacpp.BUILD_SCRIPT), *variant], env=env,
                              text=True, capture_output=True, timeout=60)
    return tmp_path, build


def test_the_noamx_build_switches_amx_off_at_the_compiler_in_its_own_directory(fake_cmake):
    tmp_path, build = fake_cmake
    done = build("noamx")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].endswith("vendor/llama.cpp/build-noamx/bin")
    args = (tmp_path / "configure-build-noamx.args").read_text().splitlines()
    flags = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    assert "-DGGML_NATIVE=ON" in args
    assert f"-DCMAKE_C_FLAGS={flags}" in args and f"-DCMAKE_CXX_FLAGS={flags}" in args
    native = build()
    assert native.stdout.splitlines()[-1].endswith("vendor/llama.cpp/build/bin")
    args = (tmp_path / "configure-build.args").read_text().splitlines()
    assert "-DGGML_NATIVE=ON" in args
    assert not any(a.startswith(("-DCMAKE_C_FLAGS", "-DCMAKE_CXX_FLAGS")) for a in args)


def test_a_finished_build_is_reused_and_an_unknown_variant_builds_nothing(fake_cmake):
    tmp_path, build = fake_cmake
    assert build("noamx").returncode == 0 and build("noamx").returncode == 0
    assert (tmp_path / "builds.log").read_text().splitlines() == ["build-noamx"]
    refused = build("avx9")
    assert refused.returncode == 2 and "unknown variant avx9" in refused.stderr
    assert (tmp_path / "builds.log").read_text().splitlines() == ["build-noamx"]
