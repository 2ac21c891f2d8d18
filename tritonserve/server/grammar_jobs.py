"""Grammar work off the event loop. A structured-output request's grammar (engine/structured.py:
parse, then compile for the tokenizer) takes from milliseconds to, within engine/limits.py's
bounds, about a second on a busy 2-core machine; on the loop it held /health for 10-20 s
before the bounds existed. Here it runs on worker threads (xgrammar releases the GIL while it
works), at a lower CPU priority than the engine's step and the event loop, and a request
whose grammar is not ready within `grammar_timeout` gets a 400 naming its field (the thread
finishes that compile in the background: xgrammar cannot be interrupted).

Used by both hosts: the one-engine host (server/async_engine.py) parses and compiles and hands
the engine the compiled grammar; the data-parallel front end (server/dp_engine.py) parses only
and sends the parsed grammar's JSON, which the engine process compiles off its step thread
(server/engine_process.py, with the same class).
"""
from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from tritonserve.engine import InvalidRequestError
from tritonserve.engine.structured import StructuredOutput

WORKERS = 2  # a second worker keeps one slow grammar from queueing every other one
NICE = 10  # the compile threads' niceness: the engine's step and the event loop come first


def _lower_priority() -> None:
    try:  # Linux: a thread is a task with its own niceness
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):
        pass


class GrammarJobs:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="grammar",
                                        initializer=_lower_priority)

    def submit(self, fn, *args) -> Future:
        return self._pool.submit(fn, *args)

    async def run(self, spec: StructuredOutput, fn, *args):
        """fn(*args) on a worker; InvalidRequestError(spec.param) past the timeout."""
        future = asyncio.wrap_future(self.submit(fn, *args))
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout)
        except asyncio.TimeoutError:
            raise timed_out(spec, self.timeout) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def timed_out(spec: StructuredOutput, timeout: float) -> InvalidRequestError:
    return InvalidRequestError(spec.param, f"{spec.param} did not compile within {timeout:g} s "
                               "(--grammar-timeout); give a smaller grammar")
