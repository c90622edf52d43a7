"""The service image's recipe: runtime requirements cover every package the services import and
nothing bench-only; the Dockerfile builds the kernels in a build stage and runs as a non-root
user without a compiler; .dockerignore keeps the venv and history out; CPU and GPU images have
tags of their own."""
from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "router", "workers", "costd", "llmmesh")
BENCH_ONLY = {"hdrhistogram", "matplotlib"}


def _pins(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-r"):
            names.add(re.split(r"[=<>\[]", line)[0].strip().lower().replace("_", "-"))
    return names


def _third_party_imports() -> set[str]:
    mods = set()
    for package in SERVICES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    mods.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    mods.add(node.module.split(".")[0])
    return {m for m in mods if m not in sys.stdlib_module_names and m not in (*SERVICES, "bench")}


def test_runtime_requirements_cover_every_service_import_and_nothing_bench_only():
    runtime = _pins(ROOT / "requirements-runtime.txt")
    dists = packages_distributions()
    missing = {}
    for module in _third_party_imports():
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & runtime:
            missing[module] = sorted(names)
    assert not missing, f"imported by a service but not in requirements-runtime.txt: {missing}"
    assert not runtime & BENCH_ONLY
    assert BENCH_ONLY <= _pins(ROOT / "requirements.txt")


def test_dockerfile_builds_kernels_in_a_stage_and_runs_unprivileged():
    text = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert len(stages) == 2 and stages[0].startswith("python:3.11-slim AS build")
    build, runtime = stages
    assert "python -m workers.model.kernels" in build and "g++" in build
    assert "g++" not in runtime and "apt-get" not in runtime
    assert re.search(r"^USER 10001$", runtime, flags=re.M)
    assert "requirements-runtime.txt" in build and "requirements.txt " not in build
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "var"} <= set(ignored)


def test_cpu_and_gpu_images_have_their_own_tags():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    cpu = services["worker"].get("image") or "llmmesh:cpu"
    assert cpu == "llmmesh:cpu" and services["worker-gpu"]["image"] == "llmmesh:gpu"


def test_no_demo_key_goes_into_an_image():
    """The demo tenants file (public keys) is mounted by compose, never copied into an image:
    no file the image's `COPY . .` takes holds a demo key or its digest."""
    import fnmatch
    import hashlib
    from llmmesh.apikeys import DEMO_ADMIN_KEY
    from llmmesh.cli import DEMO_KEYS
    ignored = [p.rstrip("/") for p in (ROOT / ".dockerignore").read_text().split() if not p.startswith("#")]
    needles = [k for key in (*DEMO_KEYS.values(), DEMO_ADMIN_KEY)
               for k in (key, hashlib.sha256(key.encode()).hexdigest())]
    assert "config/tenants.toml" in ignored
    copied = [p for p in (ROOT / "config").rglob("*") if p.is_file() and not any(
        fnmatch.fnmatch(str(p.relative_to(ROOT)), pattern) for pattern in ignored)]
    assert copied, "config/ holds the models and prices files the image needs"
    holding = [str(p.relative_to(ROOT)) for p in copied if any(n in p.read_text() for n in needles)]
    assert holding == []
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for service in ("gateway", "costd"):
        assert "./config/tenants.toml:/app/config/tenants.toml:ro" in compose["services"][service]["volumes"]
