"""POST /generate: the native route and its explicit token/done/error event protocol."""
from __future__ import annotations

from aiohttp import web

from .async_engine import now
from .common import (STATE, ApiError, done_event, failure_of, failure_response,
                     new_request_id, open_sse, parse_body, sampling_params, send_sse)
from .schema import GenerateRequest, StreamTokenEvent, TokenLogprobs


def token_event(token) -> StreamTokenEvent:
    logprobs = None
    if token.logprob is not None:
        logprobs = TokenLogprobs(logprob=token.logprob, top=[
            {"token_id": t.token_id, "logprob": t.logprob} for t in token.top_logprobs or ()])
    return StreamTokenEvent(index=token.index, text=token.text, token_id=token.token_id,
                            logprobs=logprobs)


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = now()
    if state.draining:
        raise ApiError(503, "shutting_down", "the server is shutting down")
    body = await parse_body(request, GenerateRequest)
    params = sampling_params(body, body.logprobs)
    prompt_ids = (await state.engine.prompts.encode(body.prompt)
                  if isinstance(body.prompt, str) else list(body.prompt))
    request_id = new_request_id("gen")
    items = state.engine.submit(request_id, prompt_ids, params, arrival)
    try:  # from here on, however the handler ends (a hang-up included), the request ends
        if body.stream:
            return await _stream(request, state, request_id, items)
        return await _collect(state, request_id, items)
    finally:
        items.close()


async def _stream(request, state, request_id, items) -> web.StreamResponse:
    response = await open_sse(request, request_id)
    async for item in items:
        failure = failure_of(item)
        if failure is not None:
            state.metrics.observe_failure(failure.code)
            await send_sse(response, failure.model_dump())
            break
        if item.token is not None:
            await send_sse(response, token_event(item.token).model_dump(exclude_none=True))
        if item.completion is not None:
            state.metrics.observe_completion(item.completion)
            await send_sse(response, done_event(item.completion).model_dump())
    await response.write_eof()
    return response


async def _collect(state, request_id, items) -> web.Response:
    tokens = []
    async for item in items:
        failure = failure_of(item)
        if failure is not None:
            state.metrics.observe_failure(failure.code)
            return failure_response(failure, request_id)
        if item.token is not None:
            tokens.append(item.token)
        if item.completion is not None:
            state.metrics.observe_completion(item.completion)
            done = done_event(item.completion)
            body = {"request_id": request_id,
                    "text": "".join(t.text for t in tokens) + done.text,
                    "token_ids": [t.token_id for t in tokens],
                    **done.model_dump(exclude={"type", "text"})}
            if any(t.logprob is not None for t in tokens):
                body["logprobs"] = [token_event(t).logprobs.model_dump() for t in tokens]
            return web.json_response(body, headers={"X-Request-Id": request_id})
    raise ApiError(500, "engine_error", "the request ended without a result")
