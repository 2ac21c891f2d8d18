"""What a route holds of its engine requests: RequestStream (the async iterator of one HTTP
request's choices), the items it yields (GenerationStep or StreamFailure), the request as it
crosses into the engine's thread or process (NewRequest), and the refusals of submit."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from tritonserve.engine import GenerationStep, SamplingParams


class StreamOwner(Protocol):
    """The door a stream was opened by (server/async_engine.py, server/dp_engine.py)."""

    def forget(self, request_id: str) -> None: ...

    def abort(self, request_id: str) -> None: ...


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
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prefill_after: str | None  # a sibling whose prompt prefill this one waits for (n > 1)
    # the structured output's grammar, made off the event loop (server/grammar_jobs.py):
    # compiled for an engine in this process, a parsed grammar's JSON for an engine process
    grammar: object = None
    lora: str | None = None  # the LoRA adapter it runs under (engine/lora.py); None: the base


StreamItem = GenerationStep | StreamFailure


class RequestStream:
    """The items of one HTTP request's engine requests (several for n > 1 or a list of
    prompts), as an async iterator of (choice index, item). It ends after every choice's last
    item, or at the first StreamFailure. close() ends it: the choices still running are
    aborted and their KV blocks freed. close() works at any point, before the first item too,
    so a route that calls it in a `finally` leaks nothing."""

    def __init__(self, engine: StreamOwner, request_ids: list[str],
                 queue: asyncio.Queue[tuple[int, StreamItem]]) -> None:
        self._engine = engine
        self.request_ids = request_ids
        self._queue = queue
        self._running = set(range(len(request_ids)))
        self._failed = False
        self._closed = False

    @property
    def num_choices(self) -> int:
        return len(self.request_ids)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, StreamItem]:
        if not self._running or self._failed or self._closed:
            raise StopAsyncIteration
        index, item = await self._queue.get()
        if isinstance(item, StreamFailure):
            self._failed = True
        elif item.finished:
            self._running.discard(index)
        return index, item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for index, request_id in enumerate(self.request_ids):
            self._engine.forget(request_id)
            if index in self._running:  # the consumer went away, or a sibling failed
                self._engine.abort(request_id)
