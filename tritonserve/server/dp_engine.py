"""Data parallelism: N engine processes (server/engine_process.py; each may be tensor-parallel)
behind the one HTTP front end, through the same narrow door as AsyncEngine (server/
stream_hub.py's EngineDoor: submit / abort / stats / dead / card), so routes, metrics and the
watchdog do not know how many engines serve; the streams are its StreamHub's.

The front end's loop (run(), on the main thread of `tritonserve serve`) takes new requests
from the inbox, asks server/router.py for an engine, and sends them down that engine's pipe;
it waits on every engine's pipe and process at once and fans each Stepped message out to the
streams, as AsyncEngine.run() does with its own steps. Requests are checked here
(engine/request_check.py) and their grammars parsed (server/grammar_jobs.py, off the event
loop) before anything is sent, so a bad one gets its 400 from the front end; the engine gets
the parsed grammar and compiles its token masks off its step thread.

Nothing here waits on an engine while holding the lock the event loop takes: messages to an
engine go through its own outbox and writer thread, so an engine that stops reading its pipe
(stuck in a step, SIGSTOP) blocks only its writer, and costs only its own requests; the
watchdog (a thread: server/watchdog.py) takes it out.

An engine that dies (its process exits: a fault, a kill, the watchdog) is out of rotation for
good: the steps it reported are delivered, its other streams end with an `engine_dead` error
event, and the others keep serving. /health stays 200 while one engine lives; when the last
dies, `dead` is set (/health 503, `tritonserve serve` exits 1).

Each engine gets its share of the cores (engine/parallel.pin_cores), as tensor-parallel ranks
do. Arrival times cross processes as time.perf_counter() stamps (CLOCK_MONOTONIC on Linux:
one clock for every process of a machine).
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import select
import threading
import time
from multiprocessing.connection import wait

from transformers import AutoTokenizer

from tritonserve.engine import GenerationStep, SamplingParams
from tritonserve.engine.config import EngineConfig
from tritonserve.engine.request_check import RequestChecker
from tritonserve.engine.structured import StructuredOutput, parse

from .dp_placement import devices_for, split_cache
from .engine_card import EngineStats, EngineView
from .engine_process import (Abort, Died, Ready, Rejected, StartFailed, Stepped, Stop,
                             engine_main)
from .prompts import PromptTokenizer
from .router import NoEngineError, Router
from .stream_hub import EngineDoor, StreamHub
from .streams import NewRequest, StreamFailure

log = logging.getLogger("tritonserve.server.engine")

START_TIMEOUT_S = 600  # loading and, on CUDA, profiling and capturing take minutes at most
STOP_TIMEOUT_S = 10


class _PipeWake:
    """threading.Event's set / clear / wait over a pipe, so the loop can wait on it together
    with the engines' pipes (multiprocessing.connection.wait)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def fileno(self) -> int:
        return self._read

    def set(self) -> None:
        try:
            os.write(self._write, b"\0")
        except BlockingIOError:  # already full of wake-ups
            pass

    def clear(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass

    def wait(self, timeout: float | None = None) -> bool:
        return bool(select.select([self._read], [], [], timeout)[0])


@dataclasses.dataclass
class _Engine:
    process: mp.process.BaseProcess
    conn: object
    pid: int = 0
    stats: EngineStats = EngineStats()
    heard: float = 0.0  # time.monotonic() of its last message, or of work sent to it idle
    why_dead: str | None = None
    outbox: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)

    def start_writer(self, index: int) -> None:
        threading.Thread(target=self._write, name=f"engine-{index}-writer",
                         daemon=True).start()

    def _write(self) -> None:
        """The only sender on this engine's pipe: a send that blocks (the engine reads no
        more) blocks here alone. None ends it."""
        while (message := self.outbox.get()) is not None:
            try:
                self.conn.send(message)
            except (OSError, ValueError):  # it died (its sentinel tells the loop), or closed
                return


class DataParallelEngine(EngineDoor):
    def __init__(self, config: EngineConfig, size: int, routing: str = "prefix",
                 max_waiting: int = 256, served_names: tuple[str, ...] = ()) -> None:
        if size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {size}")
        context = mp.get_context("spawn")  # no forked torch / OpenMP state
        config = split_cache(config, size)
        self._engines: list[_Engine] = []
        for index in range(size):
            parent, child = context.Pipe()
            process = context.Process(
                target=engine_main, name=f"engine-{index}",
                args=(config, index, size, child, served_names, devices_for(config, index, size)))
            process.start()
            child.close()
            self._engines.append(_Engine(process, parent))
            self._engines[-1].start_writer(index)
        readies = [self._await_ready(e) for e in self._engines]
        card = dataclasses.replace(
            readies[0].card, engines=size,
            max_model_len=min(r.card.max_model_len for r in readies),
            num_kv_blocks=sum(r.card.num_kv_blocks for r in readies))
        for engine, ready in zip(self._engines, readies):
            engine.pid = ready.pid
        tokenizer = AutoTokenizer.from_pretrained(card.root)
        self.checker = RequestChecker(tokenizer, card.vocab_size, readies[0].eos_token_ids,
                                      card.max_model_len, config.limits)
        if not config.cache.enable_prefix_caching:  # no engine holds anything to route on
            routing = "least-tokens" if routing == "prefix" else routing
        self.router = Router(size, card.block_size, routing, seed=config.seed or 0)
        self.hub = StreamHub(_PipeWake(), max_waiting, config.limits)
        self.limits = config.limits
        self.prompts = PromptTokenizer(card.root, card.max_model_len)
        self.card = card
        self.stats = EngineStats()
        self._stopping = False
        self._running = False

    def _await_ready(self, engine: _Engine) -> Ready:
        try:
            if not engine.conn.poll(START_TIMEOUT_S):
                raise TimeoutError(f"no engine started within {START_TIMEOUT_S} s")
            message = engine.conn.recv()
        except (EOFError, OSError, TimeoutError) as exc:
            message = StartFailed(f"the engine process ended at start-up ({exc!r}; exit "
                                  f"code {engine.process.exitcode})")
        if isinstance(message, StartFailed):
            self._close_engines()
            raise ValueError(message.message)
        return message

    # ---- the narrow door's parts that differ ---------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        return self.checker.validate(prompt_token_ids, params)

    def make_grammar(self, spec: StructuredOutput) -> str:
        """On a grammar worker: the parsed grammar as JSON (small; a compiled one is 0.1-50
        MB), which the engine process compiles for its tokenizer."""
        return parse(spec).serialize_json()

    def engines(self) -> list[EngineView]:
        return [EngineView(i, e.why_dead is None and self.router.engines[i].alive, e.pid,
                           e.stats, self.router.engines[i].load)
                for i, e in enumerate(self._engines)]

    @property
    def step_started(self) -> float | None:
        """For server/watchdog.py: since when the longest-silent busy engine has said
        nothing (each engine reports after every step, so this is its running step's age)."""
        busy = [e.heard for i, e in enumerate(self._engines)
                if self.router.engines[i].alive and self.router.engines[i].requests]
        return min(busy) if busy else None

    def stalled(self, reason: str) -> bool:
        """The silent engine is killed; the loop then takes it out of rotation, ending its
        streams with this reason. True only when it was the last engine serving."""
        started = self.step_started
        for i, engine in enumerate(self._engines):
            if self.router.engines[i].alive and self.router.engines[i].requests \
                    and engine.heard == started:
                engine.why_dead = f"engine {i}: {reason}"
                engine.process.kill()
                break
        return self.router.num_alive <= 1

    def stop(self) -> None:
        self._stop_front(STOP_TIMEOUT_S + 5)
        if not self._running:
            self._close_engines()

    # ---- the front end's loop -------------------------------------------------------------
    def run(self) -> None:
        self._running = True
        try:
            while not self._stopping and self.dead is None:
                self._admit()
                self._wait_and_read()
        finally:
            self._running = False
            self._close_engines()

    def _admit(self) -> None:
        rejected: list[str] = []
        with self.hub.lock:  # routed under the lock: num_waiting never misses a request
            inbox, aborts, failures = self.hub.take()
            for new in inbox:
                if not self._send_new(new):
                    rejected.append(new.request_id)
        if rejected:
            self.hub.post([], StreamFailure("engine_dead", "every engine has died"), rejected)
        for request_id in aborts:
            index = self.router.owner(request_id)
            if index is not None:
                self._send(index, Abort((request_id,)))
        if failures:  # shutdown: every stream ends now, the engines drop their requests
            ended = self.hub.open_ids()
            for index in range(len(self._engines)):
                owned = tuple(r for r in ended if self.router.owner(r) == index)
                if owned:
                    self._send(index, Abort(owned))
            for request_id in ended:
                self.router.forget(request_id)
            self.hub.post([], failures[0], ended)

    def _send_new(self, new: NewRequest) -> bool:
        try:
            index = self.router.route(new.request_id, new.prompt_token_ids,
                                      new.params.max_tokens, follow=new.prefill_after)
        except NoEngineError:
            return False
        engine = self._engines[index]
        if self.router.engines[index].requests == 1:  # it was idle: its first step starts now
            engine.heard = time.monotonic()
        self._send(index, new)
        return True

    def _send(self, index: int, message) -> None:
        """Never blocks: the engine's writer thread sends it (see _Engine._write)."""
        self._engines[index].outbox.put(message)

    def _wait_and_read(self) -> None:
        live = {i: e for i, e in enumerate(self._engines) if self.router.engines[i].alive}
        waitables = [self.hub.wake]
        for engine in live.values():
            waitables += [engine.conn, engine.process.sentinel]
        ready = wait(waitables, timeout=0.5)
        self.hub.wake.clear()
        for index, engine in live.items():
            if engine.conn in ready and not self._read(index, engine):
                continue
            if engine.process.sentinel in ready or not engine.process.is_alive():
                self._read(index, engine)  # what it sent before it ended
                self._engine_died(index, engine.why_dead or
                                  f"engine {index} exited (code {engine.process.exitcode})")

    def _read(self, index: int, engine: _Engine) -> bool:
        """Everything the engine has sent; False once it is out of rotation."""
        try:
            while self.router.engines[index].alive and engine.conn.poll():
                self._take(index, engine, engine.conn.recv())
        except (EOFError, OSError):
            engine.process.join(timeout=1)
            self._engine_died(index, engine.why_dead or
                              f"engine {index} exited (code {engine.process.exitcode})")
        return self.router.engines[index].alive

    def _take(self, index: int, engine: _Engine, message) -> None:
        engine.heard = time.monotonic()  # any message, an Alive from a compiling engine too
        if isinstance(message, Stepped):
            self.router.journal(index, message.journal)
            for step in message.steps:
                self.router.stepped(step.request_id, step.token is not None, step.finished)
            engine.stats = message.stats
            self.num_steps += 1
            self.slowest_step = max(self.slowest_step, message.step_s)
            self._sum_stats()
            self.hub.post(message.steps, None, [])
        elif isinstance(message, Rejected):
            self.router.forget(message.request_id)
            self.hub.post([], StreamFailure(message.code, message.message),
                          [message.request_id])
        elif isinstance(message, Died):
            engine.why_dead = f"engine {index}: {message.reason}"
            self._engine_died(index, engine.why_dead, message.steps)

    def _engine_died(self, index: int, reason: str,
                     steps: list[GenerationStep] | None = None) -> None:
        if not self.router.engines[index].alive:
            return
        log.critical("data-parallel %s; %d engines left", reason, self.router.num_alive - 1)
        owned = self.router.engine_died(index)
        self._engines[index].stats = EngineStats()
        self._sum_stats()
        self.hub.post(steps or [], StreamFailure("engine_dead", f"the engine died: {reason}"),
                      owned)
        if self.router.num_alive == 0:  # nothing serves: every stream ends, /health 503
            self.hub.kill(reason)

    def _sum_stats(self) -> None:
        parts = [e.stats for i, e in enumerate(self._engines) if self.router.engines[i].alive]
        total = EngineStats(*(sum(getattr(s, f.name) for s in parts)
                              for f in dataclasses.fields(EngineStats)))
        self.stats = dataclasses.replace(total, kv_cache_usage=total.kv_cache_usage /
                                         max(1, len(parts)))

    def _close_engines(self) -> None:
        for engine in self._engines:
            engine.outbox.put(Stop())
            engine.outbox.put(None)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for engine in self._engines:
            engine.process.join(timeout=max(0.1, deadline - time.monotonic()))
            if engine.process.is_alive():
                engine.process.kill()
                engine.process.join(timeout=5)

