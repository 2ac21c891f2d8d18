"""One data-parallel engine in its own process (started by server/dp_engine.py with spawn):
an LLMEngine stepped on the process's main thread, fed over a pipe, pinned to its share of the
cores. The same loop as AsyncEngine.run(), with the pipe for the inbox and the event loop.

Messages are frozen dataclasses, pickled over the pipe. In: NewRequest, Abort, Stop. Out: Ready
(or StartFailed) once, then Stepped after each step (its GenerationSteps, a stats snapshot and
the prefix cache's journal: what entered and left it, for the router), Rejected for a request
add_request refused (or aborted while its grammar compiled), Alive while grammars compile and
nothing steps, and Died before the process exits 1 on EngineDeadError. An end of file on the
pipe (the front end is gone) ends the process too.

A request with a grammar arrives with the grammar parsed (server/dp_engine.py); its token
masks compile on a worker thread (server/grammar_jobs.py) while the loop steps the others,
and it joins the batch when they are ready. The front end's watchdog hears Alive meanwhile:
compile time is never a stuck step.
"""
from __future__ import annotations

import gc
import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass

from tritonserve.engine import EngineDeadError, GenerationStep, InvalidRequestError, LLMEngine
from tritonserve.engine.config import EngineConfig
from tritonserve.engine.parallel import pin_cores
from tritonserve.engine.structured import from_json

from .streams import NewRequest
from .engine_card import EngineStats, ModelCard, card_of, stats_of
from .grammar_jobs import GrammarJobs, timed_out

log = logging.getLogger("tritonserve.server.engine")

IDLE_POLL_S = 0.5  # an idle engine checks its health (tp workers) this often
COMPILE_POLL_S = 0.02  # while grammars compile and nothing steps: how often it looks
ALIVE_EVERY_S = 0.5  # Alive messages while grammars compile and nothing steps


@dataclass(frozen=True)
class Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Alive:
    """Nothing stepped since the last message, and grammars are compiling: not stuck."""


@dataclass(frozen=True)
class Ready:
    card: ModelCard
    eos_token_ids: frozenset[int]
    pid: int


@dataclass(frozen=True)
class StartFailed:
    message: str  # the exception, as a bad option or model folder reads at start-up


@dataclass(frozen=True)
class Stepped:
    steps: list[GenerationStep]
    stats: EngineStats
    journal: list[tuple[bool, bytes]]  # (entered?, block digest) in order
    step_s: float


@dataclass(frozen=True)
class Rejected:
    request_id: str
    code: str
    message: str


@dataclass(frozen=True)
class Died:
    reason: str
    steps: list[GenerationStep]  # what the failing step produced: deliver, then end the rest


def engine_main(config: EngineConfig, index: int, count: int, conn,
                served_names: tuple[str, ...], cuda_devices: str | None = None) -> None:
    """The process's target. Exit status: 0 after Stop or the front end's end, 1 on death.
    cuda_devices: this engine's GPUs (set before CUDA starts in this process)."""
    if cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [engine {index}] %(message)s")
    if config.device == "cpu":
        pin_cores(index, count)
    try:
        engine = LLMEngine(config)
    except Exception as exc:  # noqa: BLE001 - reported to the front end, which raises it
        conn.send(StartFailed(f"{type(exc).__name__}: {exc}"))
        return
    if engine.kv_cache.enable_prefix_caching:
        engine.kv_cache.journal = []
    engine.grammars  # ~1 s, now rather than at the first structured request
    conn.send(Ready(card_of(engine, served_names), engine.eos_token_ids, os.getpid()))
    gc.collect()
    gc.freeze()  # as `tritonserve serve` does: short per-step collections
    try:
        code = _serve(engine, conn)
    finally:
        engine.close()
    os._exit(code)  # skips the interpreter's final sweep of the model (~1.5 s)


class _Compiles:
    """Requests whose grammars compile on a worker: (request, its future, when it started)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.jobs = GrammarJobs(engine.config.limits.grammar_timeout)
        self.pending: dict[str, tuple[NewRequest, Future, float]] = {}

    def start(self, new: NewRequest) -> None:
        spec = new.params.structured
        future = self.jobs.submit(lambda: self.engine.grammars.compile(from_json(new.grammar),
                                                                       spec))
        self.pending[new.request_id] = (new, future, time.monotonic())

    def drop(self, request_id: str) -> bool:
        return self.pending.pop(request_id, None) is not None

    def ready(self) -> list[tuple[NewRequest, object]]:
        """(request, compiled grammar or the InvalidRequestError) for each one done or late."""
        out = []
        now = time.monotonic()
        for request_id, (new, future, started) in list(self.pending.items()):
            if future.done():
                exc = future.exception()
                out.append((new, exc if exc is not None else future.result()))
            elif now - started > self.jobs.timeout:
                out.append((new, timed_out(new.params.structured, self.jobs.timeout)))
            else:
                continue
            del self.pending[request_id]
        return out


def _serve(engine: LLMEngine, conn) -> int:
    compiles = _Compiles(engine)
    said = time.monotonic()  # when the front end last heard from this engine
    try:
        while True:
            for new, grammar in compiles.ready():
                if isinstance(grammar, Exception):
                    _reject(conn, new, grammar)
                else:
                    _add(engine, conn, new, grammar)
            if not engine.has_unfinished_requests():
                try:  # a part of the engine that died while it idled (a tp worker)
                    engine.check_health()
                except EngineDeadError as exc:
                    return _died(conn, exc)
                if not conn.poll(COMPILE_POLL_S if compiles.pending else IDLE_POLL_S):
                    if compiles.pending and time.monotonic() - said > ALIVE_EVERY_S:
                        try:
                            conn.send(Alive())
                        except OSError:  # the front end is gone
                            return 0
                        said = time.monotonic()
                    continue
            try:
                while conn.poll():
                    message = conn.recv()
                    if isinstance(message, Stop):
                        return 0
                    _take(engine, conn, message, compiles)
            except (EOFError, OSError):  # the front end is gone
                return 0
            if not engine.has_unfinished_requests():
                continue
            started = time.perf_counter()
            try:
                steps = engine.step()
            except EngineDeadError as exc:
                return _died(conn, exc)
            journal = (engine.kv_cache.take_journal() if engine.kv_cache.journal is not None
                       else [])
            conn.send(Stepped(steps, stats_of(engine), journal, time.perf_counter() - started))
            said = time.monotonic()
    finally:
        compiles.jobs.close()


def _take(engine: LLMEngine, conn, message, compiles: _Compiles) -> None:
    if isinstance(message, Abort):
        for request_id in message.request_ids:
            if compiles.drop(request_id):  # never added: the front end forgets it
                conn.send(Rejected(request_id, "aborted", "the request was aborted"))
            else:
                engine.abort(request_id)
        return
    new: NewRequest = message
    if new.grammar is not None:
        compiles.start(new)
    else:
        _add(engine, conn, new, None)


def _add(engine: LLMEngine, conn, new: NewRequest, grammar) -> None:
    try:
        engine.add_checked(new.prompt_token_ids, new.params, new.request_id,
                           new.arrival_time, new.prefill_after, grammar, lora=new.lora)
    except Exception as exc:  # noqa: BLE001 - checked by the front end; this one alone
        _reject(conn, new, exc)


def _reject(conn, new: NewRequest, exc: BaseException) -> None:
    code = "invalid_request" if isinstance(exc, InvalidRequestError) else "engine_error"
    conn.send(Rejected(new.request_id, code, str(exc)))


def _died(conn, exc: EngineDeadError) -> int:
    log.critical("the engine died: %s", exc)
    try:
        conn.send(Died(str(exc), exc.steps))
    except OSError:
        pass
    return 1
