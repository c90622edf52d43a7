"""Models the mesh can serve, found on local disk (never downloaded at run time): the catalog's
entries (llmmesh.catalog), and the GGUF metadata every service reads from them."""
from __future__ import annotations

from dataclasses import dataclass

from llmmesh.catalog import catalog_path, load_catalog

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    gguf_path: str


def resolve_model(name: str = DEFAULT_MODEL) -> ModelSpec:
    """Map a catalog name to its GGUF file (KeyError naming the catalog's models)."""
    entry = load_catalog(catalog_path()).get(name)
    return ModelSpec(name=entry.name, gguf_path=entry.gguf_path)


def read_context_length(gguf_path: str) -> int:
    """The model's trained context length, from GGUF metadata (`<arch>.context_length`)."""
    from llmmesh.tokenizer import read_gguf_metadata

    values = read_gguf_metadata(gguf_path).values
    return int(values[f"{values['general.architecture']}.context_length"])
