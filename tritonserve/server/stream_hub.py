"""The front half every engine host shares: the streams of the requests in flight, the inbox
the host's loop takes new requests and aborts from, and the door routes, metrics, the
watchdog and `__main__` call (EngineDoor, vLLM's EngineClient in spirit).

A host (server/async_engine.py: one engine on a thread; server/dp_engine.py: engine
processes) composes one StreamHub and fills in EngineDoor's host part: validate, the grammar
it wants made off the loop, engines(), step_started, stalled, run and stop. The hub's
contract:
- on the event loop: submit (checked, the grammar made on server/grammar_jobs.py's workers,
  admission against --max-waiting), abort, forget, fail_all, in_flight;
- on the host's thread: `with hub.lock: hub.take()` (new requests, aborts, failures, taken
  under the lock so num_waiting never misses a request), post (steps to their streams, one
  call_soon_threadsafe), kill (the host is dead: every stream ends, `dead` is set).
A request id stays in flight from submit until its host reports its end (not until its stream
closes), so a caller reusing an X-Request-Id is never hit by an abort or a step meant for
the request that had it before.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Callable

from tritonserve.engine import GenerationStep, InvalidRequestError, SamplingParams
from tritonserve.engine.limits import RequestLimits
from tritonserve.engine.sampling_params import SEED_LIMIT

from .engine_card import EngineStats, EngineView, ModelCard
from .grammar_jobs import GrammarJobs
from .prompts import PromptTokenizer
from .streams import (EngineUnavailableError, NewRequest, OverloadedError, RequestStream,
                      StreamFailure, StreamItem)


class StreamHub:
    def __init__(self, wake, max_waiting: int, limits: RequestLimits) -> None:
        """wake: what the host's loop sleeps on (set() wakes it): a threading.Event, or
        server/dp_engine.py's pipe that its wait() watches beside the engines' pipes."""
        self.wake = wake
        self.max_waiting = max_waiting
        self.grammar_jobs = GrammarJobs(limits.grammar_timeout)
        self.lock = threading.Lock()
        self._inbox: list[NewRequest] = []
        self._aborts: list[str] = []
        self._failures: list[StreamFailure] = []
        self._queues: dict[str, tuple[asyncio.Queue[tuple[int, StreamItem]], int]] = {}
        self._live: set[str] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.dead: str | None = None  # why the host died, once it has

    # ---- on the event loop ----------------------------------------------------------------
    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                     arrival_time: float, n: int, validate: Callable, make_grammar: Callable,
                     waiting: Callable[[], int], lora: str | None = None) -> RequestStream:
        """EngineDoor.submit with the host's validate, grammar maker and count of requests
        waiting inside it."""
        self._check_alive()
        checked = [validate(ids, params) for ids in prompts]
        grammar = None
        if params.structured is not None:  # one grammar for every prompt and choice
            grammar = await self.grammar_jobs.run(params.structured, make_grammar,
                                                  params.structured)
        self._check_alive()
        if grammar is not None and self.in_flight(request_id):  # taken while it compiled
            raise InvalidRequestError("X-Request-Id", f"X-Request-Id {request_id!r} names a "
                                      "request still in flight")
        in_host = waiting()
        if self.num_waiting(in_host) + len(prompts) * n > self.max_waiting:
            raise OverloadedError(f"{self.num_waiting(in_host)} requests are waiting "
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
                                      grammar, lora))
                first = first or choice_id
        for index, item in enumerate(new):
            self._queues[item.request_id] = (queue, index)
            self._live.add(item.request_id)
        with self.lock:
            self._inbox.extend(new)
        self.wake.set()
        return RequestStream(self, [item.request_id for item in new], queue)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineUnavailableError(f"the engine is dead ({self.dead}); restart the server")

    def in_flight(self, request_id: str) -> bool:
        """A request (or one of its n choices, `id-k`) with this id has not ended in the
        host (its stream may have closed already)."""
        return any(key == request_id or key.startswith(request_id + "-")
                   for key in self._live)

    def forget(self, request_id: str) -> None:
        """Its stream was closed: steps for it are dropped from now on."""
        self._queues.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        with self.lock:
            self._aborts.append(request_id)
        self.wake.set()

    def fail_all(self, code: str, message: str) -> None:
        """End every active stream with an error event (used at shutdown)."""
        with self.lock:
            self._failures.append(StreamFailure(code, message))
        self.wake.set()

    @property
    def num_active(self) -> int:
        return len(self._queues)

    def num_waiting(self, in_host: int) -> int:
        """Requests not yet running: the inbox's and the `in_host` the host holds."""
        with self.lock:
            return len(self._inbox) + in_host

    def open_ids(self) -> list[str]:
        return list(self._queues)

    # ---- on the host's thread -------------------------------------------------------------
    def take(self) -> tuple[list[NewRequest], list[str], list[StreamFailure]]:
        """The new requests, aborts and failures since the last take; hold `lock`."""
        taken = self._inbox, self._aborts, self._failures
        self._inbox, self._aborts, self._failures = [], [], []
        return taken

    def queued_with_lora(self, name: str) -> int:
        """Requests in the inbox (not yet in the engine) under that adapter; hold the lock."""
        return sum(1 for new in self._inbox if new.lora == name)

    def post(self, steps: list[GenerationStep], failure: StreamFailure | None,
             failed_ids: list[str]) -> None:
        """Steps to their streams, and `failure` to the `failed_ids`' streams, on the loop."""
        if self.loop is not None and (steps or failed_ids):
            self.loop.call_soon_threadsafe(self._dispatch, steps, failure, failed_ids)

    def kill(self, reason: str, steps: list[GenerationStep] | None = None) -> None:
        """The host is dead (from any thread): `dead` at once (/health 503, submit refuses),
        then on the loop its last steps delivered and every other stream ended."""
        self.dead = reason
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._die, steps or [], reason)

    # ---- on the event loop, from the host -------------------------------------------------
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

    def _die(self, steps: list[GenerationStep], reason: str) -> None:
        self.dead = reason
        self._dispatch(steps, None, [])
        failure = StreamFailure("engine_dead", f"the engine died: {reason}")
        self._dispatch([], failure, list(self._queues))
        self._live.clear()


class EngineDoor:
    """What routes, metrics, the watchdog and `__main__` call, whichever host serves. The
    stream half is the hub's; a host sets hub, card, prompts, limits and stats, and writes
    the host half: validate, make_grammar, engines, step_started, stalled, run, stop."""

    hub: StreamHub
    card: ModelCard
    prompts: PromptTokenizer
    limits: RequestLimits  # engine/limits.py: the routes read the server-side ones
    stats: EngineStats  # a snapshot the host swaps in whole (read without a lock)
    num_steps = 0
    slowest_step = 0.0  # seconds, read by server/watchdog.py
    _thread: threading.Thread | None = None

    # ---- the stream half ------------------------------------------------------------------
    async def submit(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                     arrival_time: float, n: int = 1, lora: str | None = None
                     ) -> RequestStream:
        """n choices for each prompt (choice index = prompt index * n + j); every prompt is
        validated, its grammar made (off the loop) and admission checked before anything
        is enqueued, so this raises InvalidRequestError, OverloadedError or
        EngineUnavailableError having done nothing. The n choices of a prompt share its
        prefill: the first runs it, the others wait for it and then find the prompt's full
        blocks in the prefix cache. A seeded request's choice j samples with seed + j. Close
        the returned stream in a `finally`. lora: the adapter every choice runs under (the
        card's `loras`)."""
        return await self.hub.submit(request_id, prompts, params, arrival_time, n,
                                     self.validate, self.make_grammar,
                                     lambda: self.stats.num_waiting, lora)

    def in_flight(self, request_id: str) -> bool:
        return self.hub.in_flight(request_id)

    def abort(self, request_id: str) -> None:
        self.hub.abort(request_id)

    def fail_all(self, code: str, message: str) -> None:
        self.hub.fail_all(code, message)

    # why the host died (None while it serves); streams open; requests not yet running
    dead = property(lambda self: self.hub.dead)
    num_active = property(lambda self: self.hub.num_active)
    num_waiting = property(lambda self: self.hub.num_waiting(self.stats.num_waiting))
    grammar_jobs = property(lambda self: self.hub.grammar_jobs)

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self.hub.loop = loop

    def _stop_front(self, join_s: float) -> None:
        """stop()'s part every host shares: run() told to end, the prompt and grammar workers
        closed, run()'s thread (start_thread) given join_s seconds to end."""
        self._stopping = True
        self.hub.wake.set()
        self.prompts.close()
        self.hub.grammar_jobs.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=join_s)

    def start_thread(self) -> None:
        """run() on a thread of its own (tests; `tritonserve serve` runs it on the main
        thread)."""
        self._thread = threading.Thread(target=self.run, name="engine", daemon=True)
        self._thread.start()

    # ---- the host half --------------------------------------------------------------------
    async def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (server/routes_cluster.py); False while requests run."""
        raise InvalidRequestError("flush_cache", "this host (--data-parallel-size > 1) "
                                  "cannot flush its engines' caches")

    async def load_lora(self, name: str, folder: str) -> None:
        """Serves a LoRA adapter from now on (server/routes_lora.py)."""
        raise InvalidRequestError("lora_name", "adapters cannot be loaded at run time by "
                                  "this host (--data-parallel-size > 1): start with "
                                  "--lora-modules")

    async def unload_lora(self, name: str) -> None:
        """Stops serving an adapter no request uses (refused while one does)."""
        raise InvalidRequestError("lora_name", "adapters cannot be unloaded at run time by "
                                  "this host (--data-parallel-size > 1)")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        raise NotImplementedError

    def make_grammar(self, spec):
        """On a grammar worker: what NewRequest.grammar carries to the host's engine."""
        raise NotImplementedError

    def engines(self) -> list[EngineView]:
        raise NotImplementedError

    @property
    def step_started(self) -> float | None:
        """For server/watchdog.py: when the running step began (None between steps)."""
        raise NotImplementedError

    def stalled(self, reason: str) -> bool:
        """On the watchdog's thread: a step hangs. True: nothing is left serving."""
        raise NotImplementedError

    def run(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError
