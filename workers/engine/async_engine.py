"""The asyncio face of the engine, used by the gRPC servicer. One background thread owns the
EngineCore and runs the step loop; the event loop only queues commands and relays outputs."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from llmmesh.errors import AlreadyExists
from llmmesh.vocab import FinishReason
from workers.engine.config import CacheInfo, EngineConfig
from workers.engine.engine_core import EngineCore
from workers.engine.outputs import EngineLoad, RequestOutput
from workers.engine.request import Priority
from workers.engine.sampling import SamplingParams
from workers.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class AsyncEngine:
    """Serves one or more models (one EngineCore each) from a single step thread.

    The model given at construction is the default one (`model=None` in calls); `add_model`
    loads another beside the running ones (weights and KV pool are built in a helper thread, so
    the step loop keeps stepping) and `remove_model` drops an idle one. Each iteration of the
    loop runs one step of one core: a core holding interactive work goes first, and a core kept
    waiting `MAX_SKIPPED_ITERATIONS` iterations gets the next one, so batch on one model slows
    but never starves behind chat on another. Each step bills its wall time to its own requests,
    so per-request device time still sums to the engine's busy time.
    """

    MAX_SKIPPED_ITERATIONS = 4

    def __init__(self, config: EngineConfig | None = None, model: LlamaForCausalLM | None = None,
                 name: str = "") -> None:
        self.config = config
        self.default_model = name
        self._model = model
        self._cores: dict[str, EngineCore] = {}     # event-loop side: what requests may name
        self._active: dict[str, EngineCore] = {}    # step-thread side (attach/detach commands)
        self._skipped: dict[str, int] = {}          # step thread: iterations a busy core waited
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wakeup = threading.Condition()
        self._commands: list[tuple[str, object]] = []   # guarded by _wakeup
        self._stopping = False
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}   # event-loop side only
        self._owner: dict[str, str] = {}            # request id -> model, event-loop side only
        self._loads: dict[str, EngineLoad] = {}     # snapshots published by the step thread
        self._detached: dict[str, asyncio.Future] = {}
        self._on_step = None
        # Steps failed in a row (step thread writes, health reads): > 0 means the engine cannot
        # serve now, and the worker's health says NOT_SERVING until a step succeeds again.
        self.num_failed_steps = 0

    @property
    def cache_info(self) -> CacheInfo:
        return self._started_core().cache_info

    @property
    def models(self) -> list[str]:
        return list(self._cores)

    @property
    def on_step(self):
        return self._on_step

    @on_step.setter
    def on_step(self, hook) -> None:
        """Called from the step thread after each step: (model, seconds, tokens, requests)."""
        self._on_step = hook
        for name, core in self._cores.items():
            core.on_step = self._step_hook(name)

    def _step_hook(self, name: str):
        hook = self._on_step
        return None if hook is None else (lambda *step: hook(name, *step))

    async def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._loop = asyncio.get_running_loop()
        # Loading weights and allocating the KV cache take seconds: keep them off the loop.
        if self.config is not None:   # else: models come with add_model
            core = await asyncio.to_thread(self._build_core, self.config, self._model)
            self._model = None
            self._cores = {self.default_model: core}
            self._active = dict(self._cores)
            self._loads = {self.default_model: core.load()}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="llmmesh-engine", daemon=True)
        self._thread.start()

    @staticmethod
    def _build_core(config: EngineConfig, model: LlamaForCausalLM | None) -> EngineCore:
        core = EngineCore(config, model)
        if config.calibrate:
            core.calibrate()
        return core

    async def add_model(self, name: str, config: EngineConfig,
                        model: LlamaForCausalLM | None = None) -> EngineCore:
        """Load a model beside the running ones; requests may name it once this returns."""
        self._check_started()
        if name in self._cores:
            raise ValueError(f"model {name!r} is already hosted")
        core = await asyncio.to_thread(self._build_core, config, model)
        core.on_step = self._step_hook(name)
        self._cores[name] = core
        self._submit("attach", (name, core))   # before any request for it: commands keep order
        return core

    async def remove_model(self, name: str) -> None:
        """Drop a model with no requests in flight (ValueError otherwise); its weights and KV
        pool are freed once this returns (the caller may then trim the heap)."""
        if name not in self._cores:
            raise KeyError(name)
        if any(m == name for m in self._owner.values()):
            raise ValueError(f"model {name!r} has requests in flight")
        del self._cores[name]
        done = self._loop.create_future()
        self._detached[name] = done
        self._submit("detach", name)
        await done

    async def shutdown(self) -> None:
        """Stop the step loop; requests still in flight end with an error output."""
        if self._thread is None:
            return
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: SamplingParams, *, priority: int = 0,
                       cache_salt: str = "", model: str | None = None,
                       tenant: str = "", resumed: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last has finished=True and the usage. Leaving the
        iteration early (break, cancellation) aborts the request and frees its blocks."""
        name = self.default_model if model is None else model
        core = self.core_of(name)
        if request_id in self._streams:
            raise AlreadyExists(f"request_id {request_id!r} is already in flight on this worker")
        request = core.make_request(request_id, prompt_token_ids, sampling,
                                    priority=priority, cache_salt=cache_salt, tenant=tenant,
                                    resumed=resumed)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = queue
        self._owner[request_id] = name
        if request.priority == Priority.INTERACTIVE:
            core.priority.interactive_arrived()
        self._submit("add", (name, request))
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._streams.pop(request_id, None)
                self._submit("abort", (self._owner.pop(request_id, name), request_id))

    def abort(self, request_id: str) -> bool:
        """Abort an in-flight request; its stream ends with finish_reason CANCELLED."""
        if request_id not in self._streams:
            return False
        self._submit("abort", (self._owner[request_id], request_id))
        return True

    def num_in_flight(self, model: str) -> int:
        return sum(1 for m in self._owner.values() if m == model)

    @property
    def scheduler(self):
        """The default core's scheduler, read-only from other threads (its counters, for metrics)."""
        return self._started_core().scheduler

    @property
    def core(self) -> EngineCore:
        return self._started_core()

    def core_of(self, model: str) -> EngineCore:
        self._check_started()
        core = self._cores.get(model)
        if core is None:
            raise KeyError(f"model {model!r} is not loaded in this engine")
        return core

    def load(self, model: str | None = None) -> EngineLoad:
        self._check_started()
        name = self.default_model if model is None else model
        load = self._loads.get(name)
        # A model attached since the step thread's last snapshot: read its core directly.
        return load if load is not None else self.core_of(name).load()

    def loads(self) -> dict[str, EngineLoad]:
        return {name: self.load(name) for name in self._cores}

    def _check_started(self) -> None:
        if self._thread is None:
            raise RuntimeError("engine not started: await start() first")

    def _started_core(self) -> EngineCore:
        self._check_started()
        core = self._cores.get(self.default_model)
        if core is None:   # the default model was removed: any hosted one stands for it
            core = next(iter(self._cores.values()), None)
        if core is None:
            raise RuntimeError("no model is loaded in this engine")
        return core

    def _submit(self, kind: str, payload: object) -> None:
        with self._wakeup:
            self._commands.append((kind, payload))
            self._wakeup.notify()

    # --- step thread: the only code that touches the EngineCores after start() ---

    def _has_work(self) -> bool:
        return any(core.has_work() for core in self._active.values())

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not (self._commands or self._stopping or self._has_work()):
                    self._wakeup.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            outputs = [out for kind, payload in commands for out in self._apply(kind, payload)]
            if stopping:
                for core in self._active.values():
                    outputs += core.abort_all("engine shut down")
            else:
                name = self._pick()
                if name is not None:
                    outputs += self._step(self._active[name])
            # Every core's snapshot: commands (adds, aborts) change loads without a step.
            self._loads = {n: core.load() for n, core in self._active.items()}
            self._publish(outputs)
            if stopping:
                return

    def _pick(self) -> str | None:
        """The core to step: one kept waiting too long, else interactive work first, else the
        one that waited longest."""
        busy = [n for n, c in self._active.items() if c.has_work()]
        if not busy:
            return None
        if len(busy) == 1:
            name = busy[0]
        else:
            starved = [n for n in busy if self._skipped.get(n, 0) >= self.MAX_SKIPPED_ITERATIONS]
            chat = [n for n in busy if self._active[n].scheduler.has_interactive()]
            pool = starved or chat or busy
            name = max(pool, key=lambda n: self._skipped.get(n, 0))
        for n in busy:
            self._skipped[n] = 0 if n == name else self._skipped.get(n, 0) + 1
        return name

    def _apply(self, kind: str, payload) -> list[RequestOutput]:
        if kind == "attach":
            name, core = payload
            self._active[name] = core
            return []
        if kind == "detach":
            core = self._active.pop(payload, None)
            self._skipped.pop(payload, None)
            outputs = core.abort_all("model unloaded") if core is not None else []
            del core
            self._loop.call_soon_threadsafe(self._resolve_detach, payload)
            return outputs
        name, item = payload
        core = self._active.get(name)
        if kind == "abort":
            output = core.abort_request(item) if core is not None else None
            return [] if output is None else [output]
        try:
            if core is None:
                raise ValueError(f"model {name!r} is not loaded")
            core.add_request(item)
        except ValueError as exc:
            return [RequestOutput(item.request_id, [], None, True, FinishReason.ERROR, None, str(exc))]
        return []

    def _resolve_detach(self, name: str) -> None:
        done = self._detached.pop(name, None)
        if done is not None and not done.done():
            done.set_result(None)

    def _step(self, core: EngineCore) -> list[RequestOutput]:
        try:
            outputs = core.step()
        except Exception as exc:   # a failed step must not kill the loop that serves everyone
            self.num_failed_steps += 1
            log.exception("engine step failed (%d in a row); failing the running requests",
                          self.num_failed_steps)
            return core.fail_running(f"engine step failed: {exc!r}")
        self.num_failed_steps = 0
        return outputs

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        try:
            self._loop.call_soon_threadsafe(self._deliver, outputs)
        except RuntimeError:
            log.warning("event loop closed; dropped %d outputs", len(outputs))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._streams.get(output.request_id)
            if queue is None:
                continue   # the consumer already left; its abort is queued
            queue.put_nowait(output)
            if output.finished:
                del self._streams[output.request_id]
                self._owner.pop(output.request_id, None)
