"""The asyncio face of the engine, used by the gRPC servicer. One background thread owns the
EngineCore and runs the step loop; the event loop only queues commands and relays outputs."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from llmmesh.errors import AlreadyExists
from workers.engine.config import CacheInfo, EngineConfig
from workers.engine.engine_core import EngineCore
from workers.engine.outputs import EngineLoad, RequestOutput
from workers.engine.request import Priority, Request
from workers.engine.sampling import SamplingParams
from workers.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM | None = None) -> None:
        self.config = config
        self._model = model
        self._core: EngineCore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wakeup = threading.Condition()
        self._commands: list[tuple[str, Request | str]] = []   # guarded by _wakeup
        self._stopping = False
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}   # event-loop side only
        self._load: EngineLoad | None = None   # snapshot published by the step thread

    @property
    def cache_info(self) -> CacheInfo:
        return self._started_core().cache_info

    async def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._loop = asyncio.get_running_loop()
        # Loading weights and allocating the KV cache take seconds: keep them off the loop.
        self._core = await asyncio.to_thread(EngineCore, self.config, self._model)
        if self.config.calibrate:
            await asyncio.to_thread(self._core.calibrate)
        self._load = self._core.load()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="llmmesh-engine", daemon=True)
        self._thread.start()

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
                       cache_salt: str = "") -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last has finished=True and the usage. Leaving the
        iteration early (break, cancellation) aborts the request and frees its blocks."""
        core = self._started_core()
        if request_id in self._streams:
            raise AlreadyExists(f"request_id {request_id!r} is already in flight on this worker")
        request = core.make_request(request_id, prompt_token_ids, sampling,
                                    priority=priority, cache_salt=cache_salt)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = queue
        if request.priority == Priority.INTERACTIVE:
            core.priority.interactive_arrived()
        self._submit("add", request)
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._streams.pop(request_id, None)
                self._submit("abort", request_id)

    def abort(self, request_id: str) -> bool:
        """Abort an in-flight request; its stream ends with finish_reason "abort"."""
        if request_id not in self._streams:
            return False
        self._submit("abort", request_id)
        return True

    @property
    def scheduler(self):
        """The core's scheduler, read-only from other threads (its counters, for metrics)."""
        return self._started_core().scheduler

    @property
    def core(self) -> EngineCore:
        return self._started_core()

    def load(self) -> EngineLoad:
        if self._load is None:
            raise RuntimeError("engine not started")
        return self._load

    def _started_core(self) -> EngineCore:
        if self._core is None or self._thread is None:
            raise RuntimeError("engine not started: await start() first")
        return self._core

    def _submit(self, kind: str, payload: Request | str) -> None:
        with self._wakeup:
            self._commands.append((kind, payload))
            self._wakeup.notify()

    # --- step thread: the only code that touches the EngineCore after start() ---

    def _run(self) -> None:
        core = self._core
        while True:
            with self._wakeup:
                while not (self._commands or self._stopping or core.has_work()):
                    self._wakeup.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            outputs = [out for kind, payload in commands for out in self._apply(kind, payload)]
            if stopping:
                outputs += core.abort_all("engine shut down")
            elif core.has_work():
                outputs += self._step()
            self._load = core.load()
            self._publish(outputs)
            if stopping:
                return

    def _apply(self, kind: str, payload: Request | str) -> list[RequestOutput]:
        if kind == "abort":
            output = self._core.abort_request(payload)
            return [] if output is None else [output]
        try:
            self._core.add_request(payload)
        except ValueError as exc:
            return [RequestOutput(payload.request_id, [], None, True, "error", None, str(exc))]
        return []

    def _step(self) -> list[RequestOutput]:
        try:
            return self._core.step()
        except Exception as exc:   # a failed step must not kill the loop that serves everyone
            log.exception("engine step failed; failing the running requests")
            return self._core.fail_running(f"engine step failed: {exc!r}")

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
