"""The gateway's view of the model catalog: a tokenizer and context length per model, rebuilt
when the catalog changes, and each model's live state from the workers' leases."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping

from redis.exceptions import RedisError

from gateway.validation import ServedModel
from llmmesh import queue
from llmmesh.catalog import Catalog, CatalogFile
from llmmesh.models import read_context_length
from llmmesh.tokenizer import Tokenizer

log = logging.getLogger("gateway.models")


class ModelBook(Mapping[str, ServedModel]):
    """Catalog name -> ServedModel, current with the catalog file (tokenizers cached by file)."""

    def __init__(self, catalog: CatalogFile):
        self.catalog = catalog
        self._tokenizers: dict[str, tuple[Tokenizer, int]] = {}
        self._built_from: Catalog | None = None
        self._models: dict[str, ServedModel] = {}
        self._current()

    @property
    def default(self) -> str:
        return self._current_catalog().default

    def _current_catalog(self) -> Catalog:
        return self.catalog.current()

    def _current(self) -> dict[str, ServedModel]:
        catalog = self._current_catalog()
        if catalog is not self._built_from:
            models = {}
            for entry in catalog.models.values():
                try:
                    path = entry.gguf_path
                    if path not in self._tokenizers:
                        self._tokenizers[path] = (Tokenizer.from_gguf(path), read_context_length(path))
                except (OSError, ValueError, KeyError) as exc:
                    if self._built_from is None and entry.name == catalog.default:
                        raise
                    log.error("catalog model %s left out: %s", entry.name, exc)
                    continue
                tokenizer, context = self._tokenizers[path]
                if entry.context_length:
                    context = min(context, entry.context_length)
                models[entry.name] = ServedModel(entry.name, context, entry.quantization, tokenizer,
                                                 entry.allowed_tenants, entry.description)
            self._models, self._built_from = models, catalog
        return self._models

    def __getitem__(self, name: str) -> ServedModel:
        return self._current()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())


async def live_states(redis) -> dict[str, dict]:
    """Model -> {"state", "quantization", "loaded_on"} over the live workers' leases."""
    rank = {"loaded": 3, "loading": 2, "unloaded": 1}
    out: dict[str, dict] = {}
    try:
        async for key in redis.scan_iter(match=f"{queue.WORKER_KEY_PREFIX}*", count=100):
            raw = await redis.get(key)
            try:
                lease = json.loads(raw) if raw else {}
            except ValueError:
                continue
            for m in lease.get("models") or ():
                if not isinstance(m, dict) or not isinstance(m.get("name"), str):
                    continue
                state = m.get("state", "unloaded")
                seen = out.setdefault(m["name"], {"state": "unloaded", "quantization": "",
                                                  "loaded_on": 0})
                if rank.get(state, 0) > rank.get(seen["state"], 0):
                    seen["state"] = state
                seen["loaded_on"] += state == "loaded"
                seen["quantization"] = seen["quantization"] or m.get("quantization", "")
    except RedisError as exc:
        log.warning("could not read worker leases for model states: %s", exc)
    return out


def describe(models: Mapping[str, ServedModel], live: dict[str, dict]) -> list[dict]:
    """One row per catalog model: what ListModels and /v1/models answer."""
    rows = []
    for m in models.values():
        state = live.get(m.name, {})
        rows.append({"name": m.name, "context_length": m.context_length,
                     "quantization": state.get("quantization") or m.quantization,
                     "state": state.get("state", "unavailable"),
                     "num_workers_loaded": state.get("loaded_on", 0),
                     "description": m.description})
    return rows
