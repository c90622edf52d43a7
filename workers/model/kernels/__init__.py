"""AVX2/FMA CPU kernels (int8/int4 GEMM, fused norm/RoPE/attention), compiled at first use.

The build needs only AVX2/FMA/F16C; qgemm_vnni.cpp alone is compiled for AVX-512 VNNI (a
target pragma) and is called only when cpuid reports avx512f/bw/vl/dq/vnni at run time, so one
cached build is correct on every CPU (no ISA in the cache key needed: nothing in it assumes
more than AVX2). `ext.isa()` says which GEMM tiles run; LLMMESH_KERNEL_ISA=avx2 forces AVX2.

`cpu_kernels()` returns the extension module, or None when this CPU lacks AVX2/FMA/F16C or the
build fails (a warning is logged once); callers then take the pure-torch path. The build takes
~1 min on a 2-core host and is cached under ~/.cache/llmmesh/kernels (LLMMESH_KERNEL_CACHE
overrides); `python -m workers.model.kernels` builds it ahead of time. LLMMESH_NO_KERNELS=1
forces the torch path (tests of the fallback, A/B measurements).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_SOURCES = ("module.cpp", "pool.cpp", "qgemm.cpp", "qgemm_vnni.cpp", "qgemm_amx.cpp",
            "attention_avx512.cpp", "fused_ops.cpp", "decoder_stack.cpp")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DNDEBUG"]
_REQUIRED_CPU_FLAGS = {"avx2", "fma", "f16c"}


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _cpu_supported() -> bool:
    return _REQUIRED_CPU_FLAGS <= _cpu_flags()


# Rows from which a projection goes through oneDNN's bf16 GEMM on a bf16 copy of its weight
# instead of the packed int8/int4 tiles: prefill chunks. Decode batches stay on the tiles, which
# stream 2-4x fewer weight bytes: on the 2-core Xeon, int4 decode @32 was 546-551 tok/s with
# this at 16 rows and 686-703 at 64, prefill @32 unchanged (~3,200).
_DENSE_MIN_ROWS = 64
# With AMX the copy is packed for our own AMX tiles (qgemm_amx.cpp), which beat the int4/int8
# tiles from 8-16 rows on the 2-core AMX Xeon (one layer's projections at 32 rows: 0.25 ms vs
# 0.73 ms): decode batches go there too.
_DENSE_MIN_ROWS_AMX = 16


@functools.lru_cache(maxsize=1)
def dense_prefill_min_rows() -> int:
    """0 when every call keeps the packed tiles. LLMMESH_DENSE_PREFILL=auto (default: on where
    the CPU has AMX-bf16, whose bf16 tiles are several times faster than our int8 ones), on or
    off; LLMMESH_DENSE_PREFILL_MIN_ROWS sets the threshold.

    Not on AVX-512 bf16 alone: on a 2-core Zen 4 (AVX-512 bf16 and VNNI, no AMX) oneDNN's bf16
    GEMM ran 436 GFLOP/s against 566 GOP/s for our VNNI pair tiles, and prompts through the
    tiles instead of the bf16 copies measured int4 prefill @32 1,236 -> 1,836 tok/s, int8
    1,327 -> 1,875, int4 @1 1,195 -> 1,909 (medians of 3, same process kind, 2026-12-04);
    perplexity (2,048 tokens) int4 14.483 -> 14.536, int8 14.470 -> 14.519, both within their
    bounds (tests/model/test_quantization.py scores both paths). On an AVX2-only CPU bf16 is
    slower than fp32."""
    setting = os.environ.get("LLMMESH_DENSE_PREFILL", "auto").lower()
    if setting in ("0", "off", "false") or cpu_kernels() is None:
        return 0
    if setting == "auto" and "amx_bf16" not in _cpu_flags():
        return 0
    default = _DENSE_MIN_ROWS_AMX if uses_amx() else _DENSE_MIN_ROWS
    return max(1, int(os.environ.get("LLMMESH_DENSE_PREFILL_MIN_ROWS", default)))


def uses_amx() -> bool:
    """Whether the bf16 copies go to our AMX tiles: the CPU has AMX-BF16, Linux grants this
    process the tile state, and LLMMESH_AMX is not off (A/B measurements)."""
    ext = cpu_kernels()
    off = os.environ.get("LLMMESH_AMX", "on").lower() in ("0", "off", "false")
    return ext is not None and not off and ext.amx_available()


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] (N % 16 == 0, K % 32 == 0) -> the AMX B-tile layout
    [N/16][K/32][16 k-pairs][16 channels][2] (qgemm_amx.h)."""
    n, k = weight.shape
    return (weight.to(torch.bfloat16).view(n // 16, 16, k // 32, 16, 2)
            .permute(0, 2, 3, 1, 4).contiguous())


def _ensure_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the pinned PyPI ninja lives in the venv's bin,
    which is not on PATH when the venv's python is called directly."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass


def _build_dir() -> Path:
    default = Path.home() / ".cache" / "llmmesh" / "kernels"
    path = Path(os.environ.get("LLMMESH_KERNEL_CACHE", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """One builder at a time, by a lock the kernel drops when its holder dies. torch's own lock
    file is a bare file that a process killed mid-build leaves behind, and every later worker
    then waits on it forever (seen when a benchmark was interrupted during a rebuild); holding
    ours, no live builder can own that file, so a leftover one is removed."""
    with open(build_dir / "llmmesh.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing a kernel build lock left by a process that died mid-build")
            stale.unlink(missing_ok=True)
        yield


@functools.lru_cache(maxsize=1)
def cpu_kernels() -> ModuleType | None:
    if os.environ.get("LLMMESH_NO_KERNELS") == "1":
        return None
    if not _cpu_supported():
        log.warning("CPU lacks AVX2/FMA/F16C: quantized weights use the slow torch dequant path")
        return None
    here = Path(__file__).resolve().parent
    _ensure_ninja_on_path()
    try:
        from torch.utils.cpp_extension import load
        with _build_lock(_build_dir()):
            # The source hash is in the name, so an edited kernel never loads a stale build.
            return load(name="llmmesh_cpu_kernels", sources=[str(here / s) for s in _SOURCES],
                        extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"],
                        build_directory=str(_build_dir()), verbose=False)
    except Exception as exc:   # compiler missing, headers missing, ...: degrade, never crash
        log.warning("CPU kernels failed to build (%s); falling back to torch dequant + matmul, "
                    "which is several times slower", str(exc).splitlines()[0] if str(exc) else exc)
        return None

