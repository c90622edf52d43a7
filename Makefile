# llmmesh: `make up` runs the whole mesh, `make test` runs the tests. Each sets itself up.
PY := .venv/bin/python

.PHONY: up test test-fast venv protos clean

venv:
	@bash scripts/setup.sh

up: venv
	.venv/bin/llmmesh up

test: venv
	$(PY) -m pytest -q -ra tests

test-fast: venv
	$(PY) -m pytest -q -ra tests -m "not model and not e2e"

protos: venv
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/llmmesh/v1/*.proto

clean:
	rm -rf .venv var .pytest_cache
