#!/usr/bin/env bash
# Builds llama.cpp's llama-server, llama-bench and llama-batched-bench (CPU only) from the
# llama.cpp source vendored inside the llama-cpp-python sdist, so the peer is pinned by one PyPI
# version and needs nothing but PyPI. Idempotent: a finished build is reused; a concurrent caller
# waits on the lock instead of building twice.
#
# Two variants, each in its own build directory of the one source tree:
#   native  -march=native, as the host allows (on an AMX CPU: llama.cpp's AMX backend)
#   noamx   -march=native without AMX, so quantized weights go to ggml's AVX2/AVX-512 repack
#           path instead: on an AMX Xeon the native build crashed (SIGSEGV in
#           ggml_backend_amx_mul_mat) on multi-token batches with repacking on
#
#   bench/peers/build_llamacpp.sh [native|noamx]   # prints the bin directory on its last line
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 JOBS=2 bench/peers/build_llamacpp.sh noamx
set -euo pipefail

VARIANT="${1:-native}"
case "$VARIANT" in
  native) BUILD_DIR=build; ISA_FLAGS=() ;;  # "build": where a pre-variant build already lies
  # GGML_AMX_TILE/INT8/BF16 are no-ops with GGML_NATIVE=ON (ggml-cpu reads them only to compose
  # -m flags when not native): the AMX code is compiled iff the compiler defines __AMX_INT8__,
  # so it is switched off at the compiler. GCC keeps an explicit -mno-* over -march=native
  # whichever comes first, and on a CPU without AMX these flags change nothing.
  noamx) BUILD_DIR=build-noamx
         NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
         ISA_FLAGS=(-DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX") ;;
  *) echo "unknown variant $VARIANT (native or noamx)" >&2; exit 2 ;;
esac
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUILD_ROOT="${LLMMESH_BENCH_BUILD:-$ROOT/bench/build}"
SRC="$BUILD_ROOT/llama_cpp_python-$VERSION"
BIN="$SRC/vendor/llama.cpp/$BUILD_DIR/bin"
TARGETS=(llama-server llama-bench llama-batched-bench)
PIP="${PIP:-$ROOT/.venv/bin/pip}"
[ -x "$PIP" ] || PIP="python3 -m pip"

mkdir -p "$BUILD_ROOT"
# One lock for every variant: they share the unpacked source.
exec 9>"$BUILD_ROOT/.build-$VERSION.lock"
flock 9

built() { for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || return 1; done; }

if ! built; then
  if [ ! -d "$SRC/vendor/llama.cpp" ]; then
    # Only the package itself as an sdist: its build tools (scikit-build-core) come as wheels,
    # since pip prepares metadata before it saves the file.
    $PIP download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$BUILD_ROOT" >&2
    tar -xzf "$BUILD_ROOT/llama_cpp_python-$VERSION.tar.gz" -C "$BUILD_ROOT"
  fi
  cd "$SRC/vendor/llama.cpp"
  # Release + native ISA: the peer gets the same -march=native the host allows, no GPU backends,
  # no libcurl (models are local files; nothing is downloaded at run time).
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF \
        "${ISA_FLAGS[@]}" \
        $(command -v ninja >/dev/null && echo -G Ninja) >&2
  cmake --build "$BUILD_DIR" --config Release -j "$JOBS" --target "${TARGETS[@]}" >&2
  built || { echo "build finished but binaries are missing in $BIN" >&2; exit 1; }
fi
echo "$BIN"
