"""The step watchdog: a step that runs past its limit (a deadlock, a stuck kernel) would leave
/health at 200 and every stream waiting forever (vLLM and SGLang have this hole). A thread of
its own, once a second, compares the running step's age with the limit: it depends on neither
the engine's thread nor the event loop being free (it ran as a task on the loop until a
blocked loop was seen to silence it). Past the limit, the engine counts as dead (/health 503
with the reason), every open stream ends with an `engine_dead` error event (on the loop, as
soon as it runs), and `on_stall` runs: the server's main ends the process (exit 1) a moment
later, for a supervisor to restart it. With data-parallel engines (server/dp_engine.py) the
stuck engine alone is killed and its streams ended; the server ends only when none is left.

The limit: `--step-timeout S`; by default the larger of STEP_TIMEOUT_FLOOR and STALL_FACTOR x
the slowest step seen so far (a long prefill or the first compiled step is not a stall); 0
turns the watchdog off.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .stream_hub import EngineDoor

log = logging.getLogger("tritonserve.server")

STEP_TIMEOUT_FLOOR = 60.0  # seconds
STALL_FACTOR = 20.0


def step_limit(engine: EngineDoor, step_timeout: float | None) -> float:
    if step_timeout is not None:
        return step_timeout
    return max(STEP_TIMEOUT_FLOOR, STALL_FACTOR * engine.slowest_step)


class Watchdog:
    def __init__(self, engine: EngineDoor, step_timeout: float | None,
                 on_stall: Callable[[str], None] | None = None) -> None:
        self.engine, self.step_timeout, self.on_stall = engine, step_timeout, on_stall
        self.interval = min(1.0, step_timeout / 4) if step_timeout else 1.0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.step_timeout == 0:
            return
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        """Until the engine is dead (by the watchdog or otherwise) or stop()."""
        engine = self.engine
        while not self._stopped.wait(self.interval) and engine.dead is None:
            started, limit = engine.step_started, step_limit(engine, self.step_timeout)
            if started is None:
                continue
            age = time.monotonic() - started
            if age <= limit:
                continue
            reason = (f"a step has run {age:.1f} s, past the watchdog's {limit:.1f} s "
                      f"(--step-timeout): the engine is stuck")
            log.critical("%s; ending its streams", reason)
            if not engine.stalled(reason):  # another data-parallel engine serves on
                continue
            if self.on_stall is not None:
                self.on_stall(reason)
            return
