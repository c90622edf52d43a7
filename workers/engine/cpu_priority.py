"""OS scheduling priority for steps that hold only batch-class work (CPU devices).

On a CPU host the engine's step shares cores with everything else: another worker's steps, the
gateway relaying tokens, the router, Redis. A step with no interactive request in it is
background work, so it runs at a higher nice value; whoever has a user waiting — this worker's
next interactive step, another worker's prefill, the relays — gets the core first. On an
accelerator the step's CPU time is mostly launch overhead and this is left off.

Linux sets nice per thread. Going back down to 0 needs root, CAP_SYS_NICE or an RLIMIT_NICE that
allows it: that is probed once on a throwaway thread, and where it does not hold the feature
stays off (batch keeps the normal priority), so the step thread is never stuck low.
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)


def _can_restore_priority() -> bool:
    """Whether a thread here may lower its nice value back to 0 after raising it (root,
    CAP_SYS_NICE or RLIMIT_NICE), tried on a throwaway thread so nothing else is touched."""
    if not hasattr(os, "setpriority"):
        return False
    result: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 1)
            os.setpriority(os.PRIO_PROCESS, tid, 0)
            result.append(True)
        except OSError:
            result.append(False)
    thread = threading.Thread(target=probe, name="llmmesh-nice-probe")
    thread.start()
    thread.join()
    if not result[0]:
        log.info("no permission to restore a thread's CPU priority: batch steps run at the "
                 "normal priority")
    return result[0]


class StepPriority:
    def __init__(self, batch_nice: int | None) -> None:
        self.batch_nice = batch_nice if batch_nice and _can_restore_priority() else None
        self._lock = threading.Lock()
        self._current = 0
        self._step_tid: int | None = None
        self._interactive_pending = False

    def set_for_step(self, batch_only: bool) -> None:
        """Called by the step thread before it runs a step."""
        if self.batch_nice is None:
            return
        with self._lock:
            self._step_tid = threading.get_native_id()
            if not batch_only:
                self._interactive_pending = False
            # An interactive arrival announced after this step was planned keeps it at 0.
            self._set(self.batch_nice if batch_only and not self._interactive_pending else 0)

    def interactive_arrived(self) -> None:
        """Any thread: an interactive request is on its way in. The step in flight (batch
        only, at low priority) is what it waits for, so that step gets the normal priority
        back at once."""
        if self.batch_nice is None:
            return
        with self._lock:
            self._interactive_pending = True
            self._set(0)

    def _set(self, want: int) -> None:
        if want == self._current or self._step_tid is None:
            return
        try:
            os.setpriority(os.PRIO_PROCESS, self._step_tid, want)
        except OSError as exc:
            log.warning("cannot change the step thread's nice value (%s); batch steps keep the "
                        "normal CPU priority from now on", exc)
            self.batch_nice = None
            return
        self._current = want
