"""The one consume loop every route shares: a RequestStream sent as SSE, or collected into one
JSON body. What differs between the dialects (native, completions, chat) is a Renderer, which
only turns engine items into payloads; metrics, failures and closing the stream live here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from tritonserve.engine import Completion, PromptLogprob, TokenOutput

from .streams import RequestStream
from .common import (STATE, ApiError, NamedEvent, failure_of, failure_response, open_sse,
                     send_sse)
from .schema import StreamErrorEvent

# a JSON object, a bare SSE data string such as "[DONE]", or a frame with an event name
Payload = dict | str | NamedEvent


@dataclass
class Choice:
    """One engine request's result, collected."""

    index: int
    tokens: list[TokenOutput] = field(default_factory=list)
    completion: Completion | None = None
    prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None
    embedding: tuple[float, ...] | None = None

    @property
    def text(self) -> str:
        tail = self.completion.tail_text if self.completion is not None else ""
        return "".join(t.text for t in self.tokens) + tail


class Renderer:
    """A dialect's payloads. The stream sends start(), then prompt() / token() / finish() as
    items come (any interleaving of choices; a choice's prompt() first, when it asked for
    prompt logprobs), failure() at most once, and end() last; a collected answer is
    response() once every choice has finished."""

    def start(self) -> list[Payload]:
        return []

    def prompt(self, index: int, entries: tuple[PromptLogprob | None, ...]) -> list[Payload]:
        return []

    def token(self, index: int, token: TokenOutput) -> list[Payload]:
        raise NotImplementedError

    def finish(self, index: int, completion: Completion) -> list[Payload]:
        raise NotImplementedError

    def failure(self, failure: StreamErrorEvent) -> list[Payload]:
        raise NotImplementedError

    def end(self, choices: list[Choice], failed: bool) -> list[Payload]:
        return []

    def response(self, choices: list[Choice]) -> dict:
        raise NotImplementedError


async def respond(request: web.Request, request_id: str, items: RequestStream,
                  renderer: Renderer, stream: bool) -> web.StreamResponse:
    """However this ends (a hang-up included), the stream is closed: what still runs is
    aborted and its KV blocks freed."""
    try:
        if stream:
            return await _stream(request, request_id, items, renderer)
        return await _collect(request, request_id, items, renderer)
    finally:
        items.close()


async def _stream(request, request_id, items, renderer) -> web.StreamResponse:
    metrics = request.app[STATE].metrics
    response = await open_sse(request, request_id)
    choices = [Choice(i) for i in range(items.num_choices)]
    failed = False
    for payload in renderer.start():
        await send_sse(response, payload)
    async for index, item in items:
        failure = failure_of(item)
        if failure is not None:
            metrics.observe_failure(failure.code)
            for payload in renderer.failure(failure):
                await send_sse(response, payload)
            failed = True
            break
        if item.prompt_logprobs is not None:
            for payload in renderer.prompt(index, item.prompt_logprobs):
                await send_sse(response, payload)
        if item.token is not None:
            for payload in renderer.token(index, item.token):
                await send_sse(response, payload)
        if item.completion is not None:
            metrics.observe_completion(item.completion)
            choices[index].completion = item.completion
            for payload in renderer.finish(index, item.completion):
                await send_sse(response, payload)
    for payload in renderer.end(choices, failed):
        await send_sse(response, payload)
    await response.write_eof()
    return response


async def _collect(request, request_id, items, renderer) -> web.Response:
    metrics = request.app[STATE].metrics
    choices = [Choice(i) for i in range(items.num_choices)]
    async for index, item in items:
        failure = failure_of(item)
        if failure is not None:
            metrics.observe_failure(failure.code)
            return failure_response(failure, request_id)
        if item.prompt_logprobs is not None:
            choices[index].prompt_logprobs = item.prompt_logprobs
        if item.embedding is not None:
            choices[index].embedding = item.embedding
        if item.token is not None:
            choices[index].tokens.append(item.token)
        if item.completion is not None:
            metrics.observe_completion(item.completion)
            choices[index].completion = item.completion
    if any(c.completion is None for c in choices):
        raise ApiError(500, "engine_error", "the request ended without a result")
    return web.json_response(renderer.response(choices), headers={"X-Request-Id": request_id})
