"""One data-parallel engine in its own process (started by server/dp_engine.py with spawn):
an LLMEngine stepped on the process's main thread, fed over a pipe, pinned to its share of the
cores. The same loop as AsyncEngine.run(), with the pipe for the inbox and the event loop.

Messages are frozen dataclasses, pickled over the pipe. In: Add, Abort, Stop. Out: Ready (or
StartFailed) once, then Stepped after each step (its GenerationSteps, a stats snapshot and the
prefix cache's journal: what entered and left it, for the router), Rejected for a request
add_request refused, and Died before the process exits 1 on EngineDeadError. An end of file on
the pipe (the front end is gone) ends the process too.
"""
from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass

from tritonserve.engine import EngineDeadError, GenerationStep, InvalidRequestError, LLMEngine
from tritonserve.engine.config import EngineConfig
from tritonserve.engine.parallel import pin_cores

from .streams import NewRequest
from .engine_card import EngineStats, ModelCard, card_of, stats_of

log = logging.getLogger("tritonserve.server.engine")

IDLE_POLL_S = 0.5  # an idle engine checks its health (tp workers) this often


@dataclass(frozen=True)
class Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Stop:
    pass


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


def _serve(engine: LLMEngine, conn) -> int:
    while True:
        if not engine.has_unfinished_requests():
            try:  # a part of the engine that died while it idled (a tp worker)
                engine.check_health()
            except EngineDeadError as exc:
                return _died(conn, exc)
            if not conn.poll(IDLE_POLL_S):
                continue
        try:
            while conn.poll():
                message = conn.recv()
                if isinstance(message, Stop):
                    return 0
                _take(engine, conn, message)
        except (EOFError, OSError):  # the front end is gone
            return 0
        if not engine.has_unfinished_requests():
            continue
        started = time.perf_counter()
        try:
            steps = engine.step()
        except EngineDeadError as exc:
            return _died(conn, exc)
        journal = engine.kv_cache.take_journal() if engine.kv_cache.journal is not None else []
        conn.send(Stepped(steps, stats_of(engine), journal, time.perf_counter() - started))


def _take(engine: LLMEngine, conn, message) -> None:
    if isinstance(message, Abort):
        for request_id in message.request_ids:
            engine.abort(request_id)
        return
    new: NewRequest = message
    try:
        engine.add_request(new.prompt_token_ids, new.params, new.request_id,
                           new.arrival_time, prefill_after=new.prefill_after)
    except Exception as exc:  # noqa: BLE001 - checked by the front end; this one alone
        code = "invalid_request" if isinstance(exc, InvalidRequestError) else "engine_error"
        conn.send(Rejected(new.request_id, code, str(exc)))


def _died(conn, exc: EngineDeadError) -> int:
    log.critical("the engine died: %s", exc)
    try:
        conn.send(Died(str(exc), exc.steps))
    except OSError:
        pass
    return 1
