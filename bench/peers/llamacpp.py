"""llama.cpp built from the llama-cpp-python sdist (build_llamacpp.sh) and llama-server as a process.

`llamacpp_bin(name, variant)` is the lookup other benchmarks reuse: it builds on first use
(minutes on a 2-core host; later calls return at once) and honours LLAMA_CPP_BIN_DIR for a
prebuilt copy of the native build. `llamacpp_builds()` says which builds differ on this CPU.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BUILD_SCRIPT = Path(__file__).resolve().parent / "build_llamacpp.sh"
TOOLS = ("llama-server", "llama-bench", "llama-batched-bench")
VARIANTS = ("native", "noamx")  # build_llamacpp.sh's variants; native first: it wins ties
VARIANTS_ENV = "LLAMA_CPP_VARIANTS"  # "native,noamx" times both even where they are the same


def llamacpp_bin(name: str, variant: str = "native") -> str:
    """Path of a llama.cpp tool of one build; builds that variant's tools first if needed."""
    if name not in TOOLS:
        raise ValueError(f"unknown llama.cpp tool {name!r}; built: {', '.join(TOOLS)}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown llama.cpp build {variant!r}; built: {', '.join(VARIANTS)}")
    prebuilt = os.environ.get("LLAMA_CPP_BIN_DIR")
    if prebuilt and variant == "native":
        path = Path(prebuilt) / name
        if not path.exists():
            raise FileNotFoundError(f"LLAMA_CPP_BIN_DIR={prebuilt} has no {name}")
        return str(path)
    done = subprocess.run(["bash", str(BUILD_SCRIPT), variant], check=True, text=True,
                          stdout=subprocess.PIPE)
    return str(Path(done.stdout.strip().splitlines()[-1]) / name)


def llamacpp_version() -> str:
    """The llama-cpp-python version whose vendored llama.cpp the tools are built from."""
    for line in BUILD_SCRIPT.read_text().splitlines():
        if line.startswith("VERSION="):
            default = line.split(":-", 1)[1].rstrip('}"')
            return os.environ.get("LLAMA_CPP_PYTHON_VERSION", default)
    return "unknown"


@dataclass(frozen=True, slots=True)
class Builds:
    """The llama.cpp builds worth timing on this host, and why (a line for the report)."""

    variants: tuple[str, ...]
    reason: str

    def __post_init__(self) -> None:
        if not self.variants or set(self.variants) - set(VARIANTS):
            raise ValueError(f"builds must be among {', '.join(VARIANTS)}; got {self.variants}")


def cpu_has_amx(cpuinfo: str) -> bool:
    return any(line.startswith("flags") and "amx_tile" in line.split()
               for line in cpuinfo.splitlines())


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def llamacpp_builds(cpuinfo: str | None = None,
                    env: Mapping[str, str] = os.environ) -> Builds:
    """Both builds where -march=native compiles in llama.cpp's AMX backend, else native only:
    without AMX the noamx build is the same code, and building it costs minutes."""
    forced = env.get(VARIANTS_ENV, "")
    if forced:
        variants = tuple(v.strip() for v in forced.split(",") if v.strip())
        return Builds(variants, f"{', '.join(variants)}, as {VARIANTS_ENV} asks")
    if env.get("LLAMA_CPP_BIN_DIR"):
        return Builds(("native",), "native only: one prebuilt copy (LLAMA_CPP_BIN_DIR)")
    if cpu_has_amx(_cpuinfo() if cpuinfo is None else cpuinfo):
        return Builds(VARIANTS, "this CPU has AMX: native (llama.cpp's AMX backend) and noamx "
                                "(its AVX2/AVX-512 weight repacking) are both timed")
    return Builds(("native",), "native only: this CPU has no AMX, so the noamx build would "
                               "compile the same code")


def batched_bench_argv(variant: str, gguf_path: str, threads: int, prompt_len: int,
                       new_tokens: int, parallel: list[int]) -> list[str]:
    """llama-batched-bench over `parallel` sequences, one KV buffer sized for the largest."""
    ctx = max(parallel) * (prompt_len + new_tokens) + 256
    threads_args = ["-t", str(threads), "-tb", str(threads)] if threads else []
    return [llamacpp_bin("llama-batched-bench", variant), "-m", gguf_path, *threads_args,
            "-c", str(ctx), "-kvu", "-npp", str(prompt_len), "-ntg", str(new_tokens),
            "-npl", ",".join(map(str, parallel)), "--output-format", "jsonl"]


def batched_bench_rows(stdout: str) -> list[dict]:
    """llama-batched-bench's jsonl rows, one per sequence count (other lines are its log)."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@dataclass(frozen=True, slots=True)
class ServerBuild:
    """The build llama-server runs from, and how it was chosen (for the report)."""

    variant: str
    reason: str


# A chatbot turn: the 128-token system prompt plus a short question, a short answer.
PROBE_PROMPT_LEN, PROBE_NEW_TOKENS, PROBE_PARALLEL = 160, 32, [1, 8]


def probe_tps(variant: str, gguf_path: str, threads: int) -> float | None:
    """Prompt + generated tokens per second of one short llama-batched-bench, weight repacking
    on as llama-server runs; None where the build fails or hangs."""
    argv = batched_bench_argv(variant, gguf_path, threads, PROBE_PROMPT_LEN, PROBE_NEW_TOKENS,
                              PROBE_PARALLEL)
    try:
        done = subprocess.run(argv, check=True, text=True, capture_output=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None
    rows = batched_bench_rows(done.stdout)
    seconds = sum(r["t"] for r in rows)
    return sum(r["pl"] * (r["pp"] + r["tg"]) for r in rows) / seconds if seconds else None


def pick_server_build(scores: Mapping[str, float | None]) -> ServerBuild:
    """The fastest build that ran; the first when none did (the server will say why)."""
    ran = {v: s for v, s in scores.items() if s is not None}
    shown = ", ".join(f"{v} {'failed' if s is None else f'{s:,.0f} tok/s'}"
                      for v, s in scores.items())
    probe = (f"short llama-batched-bench probe ({PROBE_PROMPT_LEN} + {PROBE_NEW_TOKENS} tokens, "
             f"{' and '.join(map(str, PROBE_PARALLEL))} sequences): {shown}")
    if not ran:
        return ServerBuild(next(iter(scores)), f"every build failed the {probe}")
    return ServerBuild(max(ran, key=ran.__getitem__), f"the fastest that ran in a {probe}")


def choose_server_build(gguf_path: str, threads: int, builds: Builds | None = None
                        ) -> ServerBuild:
    builds = builds or llamacpp_builds()
    if len(builds.variants) == 1:
        return ServerBuild(builds.variants[0], builds.reason)
    return pick_server_build({v: probe_tps(v, gguf_path, threads) for v in builds.variants})


@dataclass
class LlamaServer:
    """One llama-server: continuous batching over `parallel` slots, on 127.0.0.1 only."""

    gguf_path: str
    port: int
    parallel: int = 32
    threads: int = 0  # 0: llama.cpp's own default (its count of physical cores)
    ctx_per_slot: int = 2560  # the longest profile request (2,000 + 300 tokens) fits a slot
    log_path: str = os.devnull
    extra_args: list[str] = field(default_factory=list)
    variant: str = "native"  # which build_llamacpp.sh build runs
    popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        # A KV region per slot (llama.cpp's default with an explicit -np). With -kvu and many
        # busy slots, a 1,500-token prompt was measured here at ~8 tok/s: on CPU the unified
        # buffer's attention spans every slot's cells.
        # --metrics for the load sampler; no web UI.
        threads = ["-t", str(self.threads), "-tb", str(self.threads)] if self.threads else []
        return [llamacpp_bin("llama-server", self.variant), "-m", self.gguf_path,
                "--host", "127.0.0.1", "--port", str(self.port), "-np", str(self.parallel),
                "-c", str(self.parallel * self.ctx_per_slot), *threads, "--metrics",
                "--no-webui", *self.extra_args]

    async def start(self, timeout_s: float = 120.0) -> None:
        argv = self.argv()
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if self.popen.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {self.popen.returncode}; "
                                       f"see {self.log_path}")
                try:
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"llama-server not healthy after {timeout_s:.0f}s")
                await asyncio.sleep(0.25)

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text from llama-server's /metrics, `llamacpp:` names without the prefix."""
    values = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:"):
            name, _, value = line.partition(" ")
            try:
                values[name.removeprefix("llamacpp:")] = float(value)
            except ValueError:
                continue
    return values
