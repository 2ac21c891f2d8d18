"""The server's one door into the engine, hosted off the event loop (the event loop never
runs a model step). Routes, metrics and `__main__` see only this: submit / abort, the
tokenizer calls (`prompts`), the model card, and an EngineStats snapshot the engine thread
takes at each step; nothing else reads LLMEngine's attributes.

`tritonserve serve` steps the engine on the process's main thread and runs the event loop in a
second thread: torch's OpenMP team is the main thread's, and small CPU ops launched from
another thread measured 30-60 % slower here (a batch-16 SmolLM2 decode step: 78 ms on the
main thread, 117 ms on a second one). Tests use start_thread() instead.

New requests and aborts cross into the thread through a locked inbox and an Event (the
thread sleeps while idle). A structured-output request's grammar is compiled before it is
queued, on server/grammar_jobs.py's workers (never on the event loop), and the engine gets it
compiled. A request id stays in flight from submit until the engine reports its end (not
until its stream closes), so a caller reusing an X-Request-Id can never be hit by an abort or
a step meant for the request that had it before. Each engine step's GenerationSteps cross back in one
call_soon_threadsafe per step, fanned out to per-request asyncio queues: no polling delay.

When the engine dies (EngineDeadError: a device fault, or steps that keep failing), the steps
it produced are delivered, every other stream ends with an `engine_dead` error, run() returns,
and from then on `dead` is set: /health and new requests answer 503 and `tritonserve serve`
exits non-zero so that a supervisor restarts it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time

from tritonserve.engine import (EngineDeadError, GenerationStep, InvalidRequestError, LLMEngine,
                                SamplingParams)
from tritonserve.engine.limits import RequestLimits
from tritonserve.engine.sampling_params import SEED_LIMIT
from tritonserve.engine.structured import StructuredOutput

from .engine_card import EngineStats, EngineView, ModelCard, card_of, stats_of
from .grammar_jobs import GrammarJobs
from .prompts import PromptTokenizer
from .streams import (EngineUnavailableError, NewRequest, OverloadedError, RequestStream,
                      StreamFailure, StreamItem)

log = logging.getLogger("tritonserve.server.engine")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256,
                 served_names: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self._open(max_waiting, PromptTokenizer(engine.model_path, engine.max_model_len),
                   card_of(engine, served_names), engine.config.limits)
        engine.grammars  # built now (~1 s): not on the event loop at the first structured request

    def _open(self, max_waiting: int, prompts: PromptTokenizer, card: ModelCard,
              limits: RequestLimits) -> None:
        """The front half every host shares (server/dp_engine.py's too): streams, inbox, stats."""
        self.max_waiting = max_waiting
        self.limits = limits  # engine/limits.py: the routes read the server-side ones
        self.grammar_jobs = GrammarJobs(limits.grammar_timeout)
        self._live: set[str] = set()  # ids the engine holds (see the module docstring)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[NewRequest] = []
        self._aborts: list[str] = []
        self._failures: list[StreamFailure] = []
        self._queues: dict[str, tuple[asyncio.Queue[tuple[int, StreamItem]], int]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.num_steps = 0
        self.dead: str | None = None  # why the engine died, once it has
        # read by server/watchdog.py: when the running step began (None between steps), and
        # the longest step so far in seconds
        self.step_started: float | None = None
        self.slowest_step = 0.0
        self.prompts = prompts
        self.card = card
        self.stats = EngineStats()

    def engines(self) -> list[EngineView]:
        """Each engine behind this door (one here; server/dp_engine.py has several)."""
        return [EngineView(0, self.dead is None, os.getpid(), self.stats, 0)]

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
        self.grammar_jobs.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if self._thread is None or not self._thread.is_alive():  # not inside a step
            self.engine.close()

    @property
    def num_active(self) -> int:
        return len(self._queues)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._inbox) + self.stats.num_waiting

    # ---- called on the event loop -------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        return self.engine.validate(prompt_token_ids, params)  # reads configuration only

    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                     arrival_time: float, n: int = 1) -> RequestStream:
        """n choices for each prompt (choice index = prompt index * n + j); every prompt is
        validated, its grammar compiled (off the loop) and admission checked before anything
        is enqueued, so this raises InvalidRequestError, OverloadedError or
        EngineUnavailableError having done nothing. The n choices of a prompt share its
        prefill: the first runs it, the others wait for it and then find the prompt's full
        blocks in the prefix cache. A seeded request's choice j samples with seed + j. Close
        the returned stream in a `finally`."""
        if self.dead is not None:
            raise EngineUnavailableError(f"the engine is dead ({self.dead}); restart the server")
        checked = [self.validate(ids, params) for ids in prompts]
        grammar = None
        if params.structured is not None:  # one grammar for every prompt and choice
            grammar = await self.grammar_jobs.run(params.structured, self._grammar,
                                                  params.structured)
        if self.dead is not None:
            raise EngineUnavailableError(f"the engine is dead ({self.dead}); restart the server")
        if grammar is not None and self.in_flight(request_id):  # taken while it compiled
            raise InvalidRequestError("X-Request-Id", f"X-Request-Id {request_id!r} names a "
                                      "request still in flight")
        if self.num_waiting + len(prompts) * n > self.max_waiting:
            raise OverloadedError(f"{self.num_waiting} requests are waiting "
                                  f"(--max-waiting {self.max_waiting})")
        queue: asyncio.Queue[tuple[int, StreamItem]] = asyncio.Queue()
        new: list[NewRequest] = []
        for ids, prompt_params in zip(prompts, checked):
            first = None
            for j in range(n):
                choice_params = prompt_params
                if j and prompt_params.seed is not None:
                    choice_params = dataclasses.replace(
                        prompt_params, seed=(prompt_params.seed + j) % SEED_LIMIT)
                choice_id = request_id if len(prompts) * n == 1 else f"{request_id}-{len(new)}"
                new.append(NewRequest(choice_id, ids, choice_params, arrival_time, first,
                                      grammar))
                first = first or choice_id
        for index, item in enumerate(new):
            self._queues[item.request_id] = (queue, index)
            self._live.add(item.request_id)
        with self._lock:
            self._inbox.extend(new)
        self._wake.set()
        return RequestStream(self, [item.request_id for item in new], queue)

    def _grammar(self, spec: StructuredOutput):
        """On a grammar worker: what NewRequest.grammar carries to this host's engine (the
        compiled grammar; server/dp_engine.py sends the parsed one instead)."""
        return self.engine.grammars.compile_spec(spec)

    def in_flight(self, request_id: str) -> bool:
        """A request (or one of its n choices, `id-k`) with this id has not ended in the
        engine (its stream may have closed already)."""
        return any(key == request_id or key.startswith(request_id + "-")
                   for key in self._live)

    def forget(self, request_id: str) -> None:
        """Its stream was closed: steps for it are dropped from now on."""
        self._queues.pop(request_id, None)

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
            if step.finished:
                self._live.discard(step.request_id)
            target = self._queues.get(step.request_id)
            if target is not None:
                target[0].put_nowait((target[1], step))
        if failure is not None:
            for request_id in failed_ids:
                self._live.discard(request_id)
                target = self._queues.get(request_id)
                if target is not None:
                    target[0].put_nowait((target[1], failure))

    def stalled(self, reason: str) -> bool:
        """On the watchdog's thread (server/watchdog.py): a step hangs. The engine counts as
        dead (/health 503) at once, and every open stream ends with an error event as soon as
        the loop runs; the step itself cannot be interrupted. True: nothing is left serving
        (the process should end)."""
        self.dead = reason
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._die, [], reason)
        return True

    def _die(self, steps: list[GenerationStep], reason: str) -> None:
        """On the event loop: deliver the dead engine's last steps, end every other stream."""
        self.dead = reason
        self._dispatch(steps, None, [])
        failure = StreamFailure("engine_dead", f"the engine died: {reason}")
        self._dispatch([], failure, list(self._queues))
        self._live.clear()

    # ---- the engine thread --------------------------------------------------------------
    def run(self) -> None:
        """The engine loop; blocks until stop()."""
        engine = self.engine
        while not self._stopping:
            rejected: list[tuple[str, StreamFailure]] = []
            with self._lock:  # admitted under the lock: num_waiting never misses a request
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                failures, self._failures = self._failures, []
                for new in inbox:
                    try:
                        engine.add_checked(new.prompt_token_ids, new.params, new.request_id,
                                           new.arrival_time, new.prefill_after, new.grammar)
                    except Exception as exc:  # noqa: BLE001 - checked before; this one alone
                        code = ("invalid_request" if isinstance(exc, InvalidRequestError)
                                else "engine_error")
                        rejected.append((new.request_id, StreamFailure(code, str(exc))))
                self._take_stats()
            for request_id, failure in rejected:
                self._post([], failure, [request_id])
            for request_id in aborts:
                engine.abort(request_id)
            if failures:
                ended = [s.request_id for s in engine.abort_all()]
                self._post([], failures[0], ended)
                continue
            if not engine.has_unfinished_requests():
                try:  # a part of the engine that died while it idled (a tp worker)
                    engine.check_health()
                except EngineDeadError as exc:
                    return self._engine_died(exc)
                self._wake.wait(timeout=0.5)  # a timeout keeps signals deliverable
                self._wake.clear()
                continue
            try:
                self.step_started = started = time.monotonic()
                steps = engine.step()
                self.slowest_step = max(self.slowest_step, time.monotonic() - started)
                self.step_started = None
            except EngineDeadError as exc:
                return self._engine_died(exc)
            if self.dead is not None:  # the watchdog gave up on that step: nothing to post
                return
            self.num_steps += 1
            self._take_stats()
            self._post(steps, None, [])

    def _engine_died(self, exc: EngineDeadError) -> None:
        """On the engine thread: dead from now on; the event loop ends the streams."""
        log.critical("the engine died: %s", exc)
        self.dead = str(exc)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._die, exc.steps, str(exc))

    def _take_stats(self) -> None:
        """On the engine thread, after admitting and after each step: one immutable
        snapshot, swapped in whole (the event loop reads it without a lock)."""
        self.stats = stats_of(self.engine)

    def _post(self, steps: list[GenerationStep], failure: StreamFailure | None,
              failed_ids: list[str]) -> None:
        if self._loop is not None and (steps or failed_ids):
            self._loop.call_soon_threadsafe(self._dispatch, steps, failure, failed_ids)


def now() -> float:
    return time.perf_counter()
