"""llama.cpp built from the llama-cpp-python sdist (build_llamacpp.sh) and llama-server as a process.

`llamacpp_bin(name)` is the lookup other benchmarks reuse: it builds on first use (minutes on a
2-core host; later calls return at once) and honours LLAMA_CPP_BIN_DIR for a prebuilt copy.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BUILD_SCRIPT = Path(__file__).resolve().parent / "build_llamacpp.sh"
TOOLS = ("llama-server", "llama-bench", "llama-batched-bench")


def llamacpp_bin(name: str) -> str:
    """Path of a llama.cpp tool; builds them all first if they are not built yet."""
    if name not in TOOLS:
        raise ValueError(f"unknown llama.cpp tool {name!r}; built: {', '.join(TOOLS)}")
    prebuilt = os.environ.get("LLAMA_CPP_BIN_DIR")
    if prebuilt:
        path = Path(prebuilt) / name
        if not path.exists():
            raise FileNotFoundError(f"LLAMA_CPP_BIN_DIR={prebuilt} has no {name}")
        return str(path)
    done = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, text=True,
                          stdout=subprocess.PIPE)
    return str(Path(done.stdout.strip().splitlines()[-1]) / name)


def llamacpp_version() -> str:
    """The llama-cpp-python version whose vendored llama.cpp the tools are built from."""
    for line in BUILD_SCRIPT.read_text().splitlines():
        if line.startswith("VERSION="):
            default = line.split(":-", 1)[1].rstrip('}"')
            return os.environ.get("LLAMA_CPP_PYTHON_VERSION", default)
    return "unknown"


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
        return [llamacpp_bin("llama-server"), "-m", self.gguf_path, "--host", "127.0.0.1",
                "--port", str(self.port), "-np", str(self.parallel),
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
