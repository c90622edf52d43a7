# llmmesh: `make up` runs the whole mesh, `make test` runs the tests. Each sets itself up.
PY := .venv/bin/python

.PHONY: up test test-fast fuzz venv protos clean bench bench-smoke bench-engine bench-scheduling bench-overhead bench-models bench-tls chaos

venv:
	@bash scripts/setup.sh

up: venv
	.venv/bin/llmmesh up

test: venv
	$(PY) -m pytest -q -ra tests

test-fast: venv
	$(PY) -m pytest -q -ra tests -m "not model and not e2e"

# Atheris over the gateway's decode + validation for 10 minutes (`make test` runs 60 s), then the
# hypothesis fuzz of the real gateway at the issue's 10,000 requests.
FUZZ_SECONDS ?= 600
fuzz: venv
	LLMMESH_FUZZ_SECONDS=$(FUZZ_SECONDS) $(PY) -m pytest -q -s -ra tests/fuzz
	LLMMESH_FUZZ_EXAMPLES=10000 $(PY) -m pytest -q -s -ra tests/e2e/test_gateway_fuzz.py

protos: venv
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/llmmesh/v1/*.proto

# Benchmarks (bench/results/<profile>.md, PNGs, bench/curves/): minutes per profile; run on a
# quiet machine. BENCH_ARGS passes options to every run, e.g. BENCH_ARGS="--scale 4".
BENCH_PROFILES ?= chatbot summarisation diurnal mixed curve
bench: venv bench-overhead
	@for p in $(BENCH_PROFILES); do .venv/bin/llmmesh bench --profile $$p $(BENCH_ARGS) || exit 1; done

# Mesh overhead: the mesh and its own worker called directly, alternating request by request
# (~1 min); writes bench/results/overhead-paired.md.
bench-overhead: venv
	$(PY) -m bench.overhead

# Two models sharing one worker's engine vs the busy one alone: TTFT p50/p95, cold start, RSS
# freed by an unload (~3 min); writes bench/results/models.md.
bench-models: venv
	$(PY) -m bench.models $(BENCH_MODELS_ARGS)

# Our engine per weight mode vs llama.cpp vs HF transformers (same run, same threads): ~15 min;
# writes bench/results/engine.md + .png. BENCH_ENGINE_ARGS="--quick" for a ~2 min smoke run.
bench-engine: venv
	$(PY) -m bench.engine $(BENCH_ENGINE_ARGS)

# What mutual TLS adds to one warm internal hop (~20 s); writes bench/results/tls-hop.md.
bench-tls: venv
	$(PY) -m bench.tls_hop

bench-smoke: venv
	$(PY) -m pytest -q -ra tests/unit/test_bench.py tests/integration/test_bench_smoke.py

clean:
	rm -rf .venv var .pytest_cache

# Scheduling promises (priority under a batch flood, tenant fairness, placement): ~15 min.
bench-scheduling: venv
	$(PY) -m bench.scheduling $(BENCH_ARGS)

# Chaos: the tests/chaos scenarios at 5x their `make test` size (~10 min); writes bench/results/chaos.md.
CHAOS_MD := bench/results/chaos.md
chaos: venv
	@{ echo "# Chaos: nothing lost, nothing billed twice"; echo; \
	   echo "- command: \`make chaos\` (LLMMESH_CHAOS_SCALE=5 pytest tests/chaos)"; \
	   echo "- commit: $$(git rev-parse --short HEAD)$$(git diff --quiet HEAD -- . ':!bench/results' || echo ' + uncommitted changes')"; \
	   echo "- machine: $$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $$(nproc) CPUs"; echo; \
	   echo "Counts from client records against the ledger (real model; costd and router scenarios: 1 worker, 2 routers; F5-Q2: 2 gateways, 2 routers, 2 workers)."; echo; \
	   echo "| scenario | sent | completed | typed errors | lost | double-billed | unbilled tokens |"; \
	   echo "|---|---|---|---|---|---|---|"; } > $(CHAOS_MD)
	@rm -f $(CHAOS_MD).notes
	LLMMESH_CHAOS_SCALE=5 LLMMESH_CHAOS_REPORT=$(abspath $(CHAOS_MD)) $(PY) -m pytest -q -s -ra tests/chaos; \
	  status=$$?; { echo; cat $(CHAOS_MD).notes 2>/dev/null; } >> $(CHAOS_MD); rm -f $(CHAOS_MD).notes; exit $$status
