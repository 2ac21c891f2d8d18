"""Hosts the LLMEngine off the event loop: the event loop never runs a model step.

`python -m server` steps the engine on the process's main thread and runs the event loop in a
second thread: torch's OpenMP team is the main thread's, and small CPU ops launched from
another thread measured 30-60 % slower here (a batch-16 SmolLM2 decode step: 78 ms on the
main thread, 117 ms on a second one). Tests use start_thread() instead.

New requests and aborts cross into the thread through a locked inbox and an Event (the
thread sleeps while idle). Each engine step's GenerationSteps cross back in one
call_soon_threadsafe per step, fanned out to per-request asyncio queues: no polling delay.

When the engine dies (EngineDeadError: a device fault, or steps that keep failing), the steps
it produced are delivered, every other stream ends with an `engine_dead` error, run() returns,
and from then on `dead` is set: /health and new requests answer 503 and `python -m server`
exits non-zero so that a supervisor restarts it.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from engine import (EngineDeadError, GenerationStep, InvalidRequestError, LLMEngine,
                    SamplingParams)

from .prompts import PromptTokenizer

log = logging.getLogger("server.engine")


class OverloadedError(RuntimeError):
    """More requests wait than --max-waiting allows."""


class EngineUnavailableError(RuntimeError):
    """The engine died; the server takes no new requests."""


@dataclass(frozen=True)
class StreamFailure:
    """Ends a stream without a completion: the engine failed, or the server shut down."""

    code: str
    message: str


@dataclass(frozen=True)
class _NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


StreamItem = GenerationStep | StreamFailure


class RequestStream:
    """The items of one request, as an async iterator. close() ends it: unless the last item
    was seen, the request is aborted and its KV blocks freed. close() works at any point,
    before the first item too, so a route that calls it in a `finally` leaks nothing."""

    def __init__(self, engine: AsyncEngine, request_id: str,
                 queue: asyncio.Queue[StreamItem]) -> None:
        self._engine = engine
        self.request_id = request_id
        self._queue = queue
        self._finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamItem:
        if self._finished or self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, StreamFailure) or item.finished:
            self._finished = True
        return item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine._queues.pop(self.request_id, None)
        if not self._finished:  # the consumer went away (client disconnect)
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[_NewRequest] = []
        self._aborts: list[str] = []
        self._failures: list[StreamFailure] = []
        self._queues: dict[str, asyncio.Queue[StreamItem]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.num_steps = 0
        self.dead: str | None = None  # why the engine died, once it has
        self.prompts = PromptTokenizer(engine.model_path, engine.max_model_len)

    # ---- lifecycle ----------------------------------------------------------------------
    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def start_thread(self) -> None:
        self._thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends run() after its current step."""
        self._stopping = True
        self._wake.set()
        self.prompts.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    @property
    def num_active(self) -> int:
        return len(self._queues)

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + self.engine.num_waiting

    # ---- called on the event loop -------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        return self.engine.validate(prompt_token_ids, params)  # reads configuration only

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               arrival_time: float) -> RequestStream:
        """Validate, admit and enqueue; raises InvalidRequestError, OverloadedError or
        EngineUnavailableError before anything is enqueued. Close the returned stream in a
        `finally`: closing it early aborts the request."""
        if self.dead is not None:
            raise EngineUnavailableError(f"the engine is dead ({self.dead}); restart the server")
        params = self.validate(prompt_token_ids, params)
        if self.num_waiting >= self.max_waiting:
            raise OverloadedError(f"{self.num_waiting} requests are waiting "
                                  f"(--max-waiting {self.max_waiting})")
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._queues[request_id] = queue
        with self._lock:
            self._inbox.append(_NewRequest(request_id, prompt_token_ids, params, arrival_time))
        self._wake.set()
        return RequestStream(self, request_id, queue)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def fail_all(self, code: str, message: str) -> None:
        """End every active stream with an error event (used at shutdown)."""
        with self._lock:
            self._failures.append(StreamFailure(code, message))
        self._wake.set()

    def _dispatch(self, steps: list[GenerationStep], failure: StreamFailure | None,
                  failed_ids: list[str]) -> None:
        for step in steps:
            queue = self._queues.get(step.request_id)
            if queue is not None:
                queue.put_nowait(step)
        if failure is not None:
            for request_id in failed_ids:
                queue = self._queues.get(request_id)
                if queue is not None:
                    queue.put_nowait(failure)

    def _die(self, steps: list[GenerationStep], reason: str) -> None:
        """On the event loop: deliver the dead engine's last steps, end every other stream."""
        self.dead = reason
        self._dispatch(steps, None, [])
        failure = StreamFailure("engine_dead", f"the engine died: {reason}")
        self._dispatch([], failure, list(self._queues))

    # ---- the engine thread --------------------------------------------------------------
    def run(self) -> None:
        """The engine loop; blocks until stop()."""
        engine = self.engine
        while not self._stopping:
            with self._lock:
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                failures, self._failures = self._failures, []
            rejected: list[str] = []
            for new in inbox:
                try:
                    engine.add_request(new.prompt_token_ids, new.params, new.request_id,
                                       new.arrival_time)
                except Exception as exc:  # noqa: BLE001 - checked before; this request alone
                    code = ("invalid_request" if isinstance(exc, InvalidRequestError)
                            else "engine_error")
                    self._post([], StreamFailure(code, str(exc)), [new.request_id])
                    rejected.append(new.request_id)
            for request_id in aborts:
                engine.abort(request_id)
            if failures:
                ended = [s.request_id for s in engine.abort_all()]
                self._post([], failures[0], ended)
                continue
            if not engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)  # a timeout keeps signals deliverable
                self._wake.clear()
                continue
            try:
                steps = engine.step()
            except EngineDeadError as exc:
                log.critical("the engine died: %s", exc)
                self.dead = str(exc)
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(self._die, exc.steps, str(exc))
                return
            self.num_steps += 1
            self._post(steps, None, [])

    def _post(self, steps: list[GenerationStep], failure: StreamFailure | None,
              failed_ids: list[str]) -> None:
        if self._loop is not None and (steps or failed_ids):
            self._loop.call_soon_threadsafe(self._dispatch, steps, failure, failed_ids)


def now() -> float:
    return time.perf_counter()
