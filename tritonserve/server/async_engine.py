"""The server's one door into the engine, hosted off the event loop (the event loop never
runs a model step). Routes, metrics and `__main__` see only this: submit / abort, the
tokenizer calls (`prompts`), the model card, and an EngineStats snapshot the engine thread
takes at each step; nothing else reads LLMEngine's attributes.

`tritonserve serve` steps the engine on the process's main thread and runs the event loop in a
second thread: torch's OpenMP team is the main thread's, and small CPU ops launched from
another thread measured 30-60 % slower here (a batch-16 SmolLM2 decode step: 78 ms on the
main thread, 117 ms on a second one). Tests use start_thread() instead.

The streams and the inbox are server/stream_hub.py's (shared with the data-parallel host):
new requests and aborts cross into the thread through its locked inbox and an Event (the
thread sleeps while idle). A structured-output request's grammar is compiled before it is
queued, on server/grammar_jobs.py's workers (never on the event loop), and the engine gets it
compiled. Each engine step's GenerationSteps cross back in one call_soon_threadsafe per step,
fanned out to per-request asyncio queues: no polling delay.

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
from collections.abc import Callable
from concurrent.futures import Future

from tritonserve.engine import EngineDeadError, InvalidRequestError, LLMEngine, SamplingParams
from tritonserve.engine.lora import load_adapter
from tritonserve.engine.structured import StructuredOutput

from .engine_card import EngineStats, EngineView, card_of, stats_of
from .prompts import PromptTokenizer
from .stream_hub import EngineDoor, StreamHub
from .streams import StreamFailure

log = logging.getLogger("tritonserve.server.engine")


class AsyncEngine(EngineDoor):
    def __init__(self, engine: LLMEngine, max_waiting: int = 256,
                 served_names: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.limits = engine.config.limits
        self.hub = StreamHub(threading.Event(), max_waiting, self.limits)
        self.prompts = PromptTokenizer(engine.model_path, engine.max_model_len)
        self.card = card_of(engine, served_names)
        self.stats = EngineStats()
        self._step_started: float | None = None
        self._stopping = False
        self._calls: list[tuple[Callable[[], object], Future]] = []  # run between steps
        engine.grammars  # built now (~1 s): not on the event loop at the first structured request

    def engines(self) -> list[EngineView]:
        """Each engine behind this door (one here; server/dp_engine.py has several)."""
        return [EngineView(0, self.dead is None, os.getpid(), self.stats, 0)]

    @property
    def step_started(self) -> float | None:
        return self._step_started

    def stop(self) -> None:
        """Ends run() after its current step."""
        self._stop_front(10)
        if self._thread is None or not self._thread.is_alive():  # not inside a step
            self.engine.close()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        return self.engine.validate(prompt_token_ids, params)  # reads configuration only

    async def reset_prefix_cache(self) -> bool:
        """On the engine thread, between two steps (the cache is its alone)."""
        self.hub._check_alive()  # a dead engine thread would never answer
        future: Future = Future()
        with self.hub.lock:
            self._calls.append((self.engine.reset_prefix_cache, future))
        self.hub.wake.set()
        return await asyncio.wait_for(asyncio.wrap_future(future), 60)

    async def load_lora(self, name: str, folder: str) -> None:
        """Read and checked on a worker thread; then the engine thread finds it by name
        (LLMEngine.loras, one dict assignment) and the card lets requests name it."""
        if name in self.card.loras or name in self.card.names():
            raise InvalidRequestError("lora_name", f"{name!r} is already served")
        engine = self.engine
        adapter = await asyncio.to_thread(load_adapter, name, folder, engine.arch,
                                          engine.config.max_lora_rank,
                                          engine.config.torch_dtype)
        engine.loras[name] = adapter
        self.card = dataclasses.replace(self.card, loras=(*self.card.loras, name))

    async def unload_lora(self, name: str) -> None:
        """The card forgets it first (new requests get 404), then no request may hold it:
        one still running or queued puts it back and refuses."""
        card = self.card
        if name not in card.loras:
            raise InvalidRequestError("lora_name", f"no adapter {name!r} is loaded")
        self.card = dataclasses.replace(card, loras=tuple(n for n in card.loras if n != name))
        with self.hub.lock:  # the engine thread admits the inbox under it: one snapshot
            users = self.hub.queued_with_lora(name) + self.engine.lora_users(name)
            if not users:
                self.engine.loras.pop(name, None)
        if users:
            self.card = card
            raise InvalidRequestError("lora_name", f"{name!r} is in use by {users} "
                                      "request(s): unload it once they end")

    def make_grammar(self, spec: StructuredOutput):
        """On a grammar worker: the compiled grammar (server/dp_engine.py sends the parsed
        one instead)."""
        return self.engine.grammars.compile_spec(spec)

    def stalled(self, reason: str) -> bool:
        """On the watchdog's thread (server/watchdog.py): a step hangs. The engine counts as
        dead (/health 503) at once, and every open stream ends with an error event as soon as
        the loop runs; the step itself cannot be interrupted. True: nothing is left serving
        (the process should end)."""
        self.hub.kill(reason)
        return True

    # ---- the engine thread --------------------------------------------------------------
    def run(self) -> None:
        """The engine loop; blocks until stop()."""
        engine, hub = self.engine, self.hub
        while not self._stopping:
            rejected: list[tuple[str, StreamFailure]] = []
            with hub.lock:  # admitted under the lock: num_waiting never misses a request
                inbox, aborts, failures = hub.take()
                calls, self._calls = self._calls, []
                for new in inbox:
                    try:
                        engine.add_checked(new.prompt_token_ids, new.params, new.request_id,
                                           new.arrival_time, new.prefill_after, new.grammar,
                                           lora=new.lora)
                    except Exception as exc:  # noqa: BLE001 - checked before; this one alone
                        code = ("invalid_request" if isinstance(exc, InvalidRequestError)
                                else "engine_error")
                        rejected.append((new.request_id, StreamFailure(code, str(exc))))
                self._take_stats()
            for request_id, failure in rejected:
                hub.post([], failure, [request_id])
            for request_id in aborts:
                engine.abort(request_id)
            for call, future in calls:  # between steps, on this thread
                try:
                    future.set_result(call())
                except Exception as exc:  # noqa: BLE001 - the caller's to report
                    future.set_exception(exc)
            if failures:
                ended = [s.request_id for s in engine.abort_all()]
                hub.post([], failures[0], ended)
                continue
            if not engine.has_unfinished_requests():
                try:  # a part of the engine that died while it idled (a tp worker)
                    engine.check_health()
                except EngineDeadError as exc:
                    return self._engine_died(exc)
                hub.wake.wait(timeout=0.5)  # a timeout keeps signals deliverable
                hub.wake.clear()
                continue
            try:
                self._step_started = started = time.monotonic()
                steps = engine.step()
                self.slowest_step = max(self.slowest_step, time.monotonic() - started)
                self._step_started = None
            except EngineDeadError as exc:
                return self._engine_died(exc)
            if self.dead is not None:  # the watchdog gave up on that step: nothing to post
                return
            self.num_steps += 1
            self._take_stats()
            hub.post(steps, None, [])

    def _engine_died(self, exc: EngineDeadError) -> None:
        """On the engine thread: dead from now on; the event loop ends the streams."""
        log.critical("the engine died: %s", exc)
        self.hub.kill(str(exc), exc.steps)

    def _take_stats(self) -> None:
        """On the engine thread, after admitting and after each step: one immutable
        snapshot, swapped in whole (the event loop reads it without a lock)."""
        self.stats = stats_of(self.engine)


def now() -> float:
    return time.perf_counter()
