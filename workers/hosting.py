"""Several catalog models in one worker, under one memory budget, loaded and unloaded on demand.

A model loads on its first request (or at start when preloaded or pinned), beside the models
already serving: weights and KV pool are built in a helper thread while the engine's single
step loop keeps stepping the others. It is unloaded when idle past its `keep_alive_s`, or, least
recently used first, when another model needs the memory; never while it has requests in
flight, and never when `pinned`. Memory is weights + the model's KV pool, measured after a
load and estimated from the GGUF's tensor table before the first.

Seconds spent loading are their own capacity category (`loading`): `take_loading_seconds()`
hands them to the capacity reporter, which sends them to costd.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import gc
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from llmmesh.aio import within
from llmmesh.catalog import CatalogFile, ModelEntry
from llmmesh.errors import DeadlineExceeded, NotFound, Unavailable
from llmmesh.tokenizer import Tokenizer
from llmmesh.v1 import worker_pb2
from workers.engine.async_engine import AsyncEngine
from workers.engine.config import EngineConfig
from workers.model.gguf_loader import read_gguf
from workers.model.quantize import resolve_quantization

log = logging.getLogger("workers.hosting")
LOADED, LOADING, UNLOADED = "loaded", "loading", "unloaded"
# Bytes per weight as loaded (int4/int8 carry a scale per 32-weight group).
_BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4 / 32, "int4": 0.5 + 4 / 32}
# Cold-start guess before a model's first load here: seconds per GiB of loaded weights + set-up.
_LOAD_S_PER_GIB, _LOAD_S_BASE = 4.0, 1.0


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of every distinct tensor a model holds: parameters, buffers and the packed weights
    quantized layers keep as plain attributes."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()

    for m in module.modules():
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            add(t)
        for v in vars(m).values():
            if isinstance(v, dict):
                for t in v.values():
                    add(t)
            else:
                add(v)
    return total


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _trim_heap() -> None:
    """Give freed memory back to the OS (glibc keeps freed arenas otherwise)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass
class Hosted:
    entry: ModelEntry
    quantization: str
    state: str = UNLOADED
    tokenizer: Tokenizer | None = None
    memory_bytes: int = 0
    load_s: float = 0.0            # measured at the last load (0: never loaded here)
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)
    context_length: int = 0
    estimated_bytes: int = 0       # before the first load: from the catalog or the GGUF
    ready: asyncio.Task | None = None

    @contextlib.contextmanager
    def held(self):
        """Held against unloading while a request runs on it."""
        self.in_flight += 1
        try:
            yield self
        finally:
            self.in_flight -= 1
            self.last_used = time.monotonic()

    def idle_s(self, now: float) -> float:
        return 0.0 if self.in_flight else now - self.last_used

    def evictable(self, now: float) -> bool:
        return (self.state == LOADED and not self.in_flight and not self.entry.pinned
                and self.idle_s(now) >= self.entry.keep_alive_s)


class ModelHost:
    """The models of one worker. Event-loop side only (the engine owns the step thread)."""

    def __init__(self, catalog: CatalogFile, base: EngineConfig, *, serve: list[str] | None = None,
                 memory_budget_bytes: int = 0, engine: AsyncEngine | None = None):
        self.catalog = catalog
        self.base = base
        self.serve = serve            # None: every catalog model
        self.memory_budget_bytes = memory_budget_bytes
        self.engine = engine or AsyncEngine()
        self.hosted: dict[str, Hosted] = {}
        self._loading_s = 0.0         # loading seconds not yet reported
        self._lock = asyncio.Lock()   # one memory decision at a time
        self.num_loads = 0
        self.num_unloads = 0

    # --- what this worker may serve ---

    def servable(self) -> list[str]:
        names = self.catalog.current().names
        return [n for n in names if self.serve is None or n in self.serve]

    def _hosted(self, name: str) -> Hosted:
        h = self.hosted.get(name)
        entry = self.catalog.current().models.get(name)
        if entry is None or (self.serve is not None and name not in self.serve):
            if h is not None and h.state != UNLOADED:
                return h          # removed from the catalog while loaded: serves what it has
            raise NotFound(f"model {name!r} is not served by this worker; it serves: "
                           f"{', '.join(self.servable()) or 'nothing'}")
        if h is None:
            h = self.hosted[name] = Hosted(entry, resolve_quantization(
                entry.quantization, self.base.device, self.base.torch_dtype))
        elif h.state == UNLOADED and h.entry != entry:
            h.entry, h.estimated_bytes = entry, 0   # a catalog edit takes effect at the next load
        return h

    def config_for(self, entry: ModelEntry) -> EngineConfig:
        kv = entry.kv_cache_mib << 20 if entry.kv_cache_mib else self.base.kv_cache_bytes
        return dataclasses.replace(
            self.base, gguf_path=entry.gguf_path,
            quantization=resolve_quantization(entry.quantization, self.base.device,
                                              self.base.torch_dtype),
            kv_cache_bytes=kv, max_model_len=entry.context_length or self.base.max_model_len)

    def estimate_bytes(self, h: Hosted) -> int:
        if h.memory_bytes:
            return h.memory_bytes
        if h.entry.memory_mib:
            return h.entry.memory_mib << 20
        if not h.estimated_bytes:
            config = self.config_for(h.entry)
            weights = sum(math.prod(t.shape) for t in read_gguf(config.gguf_path).tensors.values())
            h.estimated_bytes = (int(weights * _BYTES_PER_WEIGHT.get(h.quantization, 4.0))
                                 + config.kv_cache_bytes)
        return h.estimated_bytes

    def estimate_load_s(self, h: Hosted) -> float:
        if h.load_s:
            return h.load_s
        return _LOAD_S_BASE + _LOAD_S_PER_GIB * self._estimate_quietly(h) / 2**30

    def used_bytes(self) -> int:
        return sum(h.memory_bytes or self.estimate_bytes(h) for h in self.hosted.values()
                   if h.state != UNLOADED)

    # --- serving ---

    async def start(self, preload: list[str]) -> None:
        await self.engine.start()
        pinned = [n for n in self.servable() if self.catalog.current().models[n].pinned]
        for name in dict.fromkeys(pinned + [n for n in preload if n]):
            await self.ensure_loaded(name, None)

    @contextlib.asynccontextmanager
    async def use(self, name: str, deadline_unix_ns: int = 0):
        """The model loaded (loading it first if need be, within the deadline) and held
        against unloading while the caller runs a request on it."""
        with (await self.ensure_loaded(name, deadline_unix_ns)).held() as h:
            yield h

    async def ensure_loaded(self, name: str, deadline_unix_ns: int | None) -> Hosted:
        while True:
            h = self._hosted(name)
            if h.state == LOADED:
                h.last_used = time.monotonic()
                return h
            if h.ready is None or h.ready.done():
                h.ready = asyncio.create_task(self._load(h))
            timeout = None
            if deadline_unix_ns:
                timeout = (deadline_unix_ns - time.time_ns()) / 1e9
                if timeout <= 0:
                    raise DeadlineExceeded(f"deadline passed while model {name!r} was loading")
            try:
                # shield: one caller's deadline must not cancel a load others wait for.
                await within(asyncio.shield(h.ready), timeout)
            except TimeoutError:
                raise DeadlineExceeded(
                    f"model {name!r} is still loading on this worker (cold start about "
                    f"{self.estimate_load_s(h):.1f} s); the deadline passed first") from None

    async def _load(self, h: Hosted) -> None:
        name = h.entry.name
        async with self._lock:
            if h.state == LOADED:
                return
            need = self.estimate_bytes(h)
            await self._make_room(name, need)
            h.state = LOADING
            started = time.monotonic()
            try:
                config = self.config_for(h.entry)
                tokenizer = await asyncio.to_thread(Tokenizer.from_gguf, config.gguf_path)
                core = await self.engine.add_model(name, config)
            except asyncio.CancelledError:
                h.state = UNLOADED
                raise
            except Exception as exc:
                h.state = UNLOADED
                log.exception("loading model %s failed", name)
                raise Unavailable(f"model {name!r} failed to load on this worker: {exc}") from exc
            h.load_s = time.monotonic() - started
            self._loading_s += h.load_s
            h.tokenizer, h.context_length = tokenizer, core.cache_info.max_model_len
            h.memory_bytes = tensor_bytes(core.runner.model) + core.cache_info.kv_cache_bytes
            h.state, h.last_used = LOADED, time.monotonic()
            self.num_loads += 1
            log.info("model %s loaded in %.2f s (%s, %.0f MiB)", name, h.load_s, h.quantization,
                     h.memory_bytes / 2**20)

    async def _make_room(self, name: str, need: int) -> None:
        """Unload idle models, least recently used first, until `need` bytes fit the budget;
        waits for running requests to end when every other model is busy."""
        if not self.memory_budget_bytes:
            return
        if need > self.memory_budget_bytes:
            raise Unavailable(f"model {name!r} needs ~{need >> 20} MiB, more than this worker's "
                              f"memory budget of {self.memory_budget_bytes >> 20} MiB")
        while self.used_bytes() + need > self.memory_budget_bytes:
            idle = [h for h in self.hosted.values() if h.state == LOADED and not h.in_flight
                    and not h.entry.pinned and h.entry.name != name]
            if idle:
                await self._unload(min(idle, key=lambda h: h.last_used), "memory needed for "
                                   f"model {name}")
                continue
            if not any(h.state == LOADED and not h.entry.pinned and h.entry.name != name
                       for h in self.hosted.values()):
                raise Unavailable(f"model {name!r} does not fit beside this worker's pinned "
                                  f"models ({self.used_bytes() >> 20} MiB used of "
                                  f"{self.memory_budget_bytes >> 20} MiB)")
            await asyncio.sleep(0.05)   # every candidate is serving: wait for one to go idle

    async def _unload(self, h: Hosted, why: str) -> None:
        h.state = UNLOADED
        before = rss_bytes()
        await self.engine.remove_model(h.entry.name)
        h.tokenizer = None
        await asyncio.to_thread(_trim_heap)
        self.num_unloads += 1
        log.info("model %s unloaded (%s); RSS %.0f -> %.0f MiB", h.entry.name, why,
                 before / 2**20, rss_bytes() / 2**20)

    async def unload_idle(self) -> list[str]:
        """Unload every model idle past its keep_alive (the periodic sweep)."""
        gone = []
        async with self._lock:
            now = time.monotonic()
            for h in list(self.hosted.values()):
                if h.evictable(now):
                    await self._unload(h, f"idle {h.idle_s(now):.0f} s > keep_alive "
                                          f"{h.entry.keep_alive_s:g} s")
                    gone.append(h.entry.name)
        return gone

    async def keep_alive_loop(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.unload_idle()

    def take_loading_seconds(self) -> float:
        s, self._loading_s = self._loading_s, 0.0
        return s

    # --- reporting ---

    def states(self) -> list[worker_pb2.ModelState]:
        now = time.monotonic()
        out = []
        for name in dict.fromkeys(self.servable() + list(self.hosted)):
            try:
                h = self._hosted(name)
            except NotFound:
                continue
            load = self.engine.load(name) if h.state == LOADED else None
            out.append(worker_pb2.ModelState(
                name=name, state=h.state, quantization=h.quantization,
                num_running=load.num_running if load else 0,
                num_waiting=load.num_waiting if load else 0,
                context_length=h.context_length if h.state == LOADED else 0,
                memory_bytes=h.memory_bytes if h.state == LOADED else self._estimate_quietly(h),
                load_seconds=self.estimate_load_s(h),
                pinned=h.entry.pinned, idle_seconds=h.idle_s(now), evictable=h.evictable(now)))
        return out

    def _estimate_quietly(self, h: Hosted) -> int:
        try:
            return self.estimate_bytes(h)
        except (OSError, ValueError):
            return 0

    def lease_models(self) -> list[dict]:
        return [{"name": s.name, "state": s.state, "quantization": s.quantization,
                 "load_s": round(s.load_seconds, 3), "evictable": s.evictable}
                for s in self.states()]


class SingleModelHost:
    """One model, loaded in `engine` already and never unloaded: the ModelHost interface for
    tests and embedders that build their engine themselves."""

    def __init__(self, engine: AsyncEngine, tokenizer, name: str, quantization: str):
        self.engine = engine
        self.hosted = {name: Hosted(ModelEntry(name, source="", quantization=quantization,
                                               pinned=True), quantization, state=LOADED,
                                    tokenizer=tokenizer)}
        self.memory_budget_bytes = 0

    def servable(self) -> list[str]:
        return list(self.hosted)

    @contextlib.asynccontextmanager
    async def use(self, name: str, deadline_unix_ns: int = 0):
        h = self.hosted.get(name)
        if h is None:
            raise NotFound(f"model {name!r} is not served by this worker; it serves: "
                           f"{', '.join(self.hosted)}")
        with h.held():
            yield h

    def used_bytes(self) -> int:
        return 0

    def states(self) -> list[worker_pb2.ModelState]:
        (name, h), = self.hosted.items()
        load = self.engine.load()
        return [worker_pb2.ModelState(name=name, state=LOADED, quantization=h.quantization,
                                      num_running=load.num_running, num_waiting=load.num_waiting,
                                      context_length=self.engine.cache_info.max_model_len,
                                      pinned=True)]
