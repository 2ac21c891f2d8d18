"""POST /generate: the native route and its explicit token/done/error event protocol."""
from __future__ import annotations

from aiohttp import web

from .async_engine import now
from .common import STATE, ApiError, done_event, parse_body, sampling_params
from .operators import request_id as caller_request_id
from .driver import Choice, Payload, Renderer, respond
from .schema import GenerateRequest, StreamTokenEvent, TokenLogprobs


def token_event(token) -> StreamTokenEvent:
    logprobs = None
    if token.logprob is not None:
        logprobs = TokenLogprobs(logprob=token.logprob, top=[
            {"token_id": t.token_id, "logprob": t.logprob} for t in token.top_logprobs or ()])
    return StreamTokenEvent(index=token.index, text=token.text, token_id=token.token_id,
                            logprobs=logprobs)


class NativeRenderer(Renderer):
    """The explicit token / done / error events (docs/protocol.md); one choice."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def token(self, index, token) -> list[Payload]:
        return [token_event(token).model_dump(exclude_none=True)]

    def finish(self, index, completion) -> list[Payload]:
        return [done_event(completion, self.request_id).model_dump(exclude_none=True)]

    def failure(self, failure) -> list[Payload]:
        return [failure.model_dump()]

    def response(self, choices: list[Choice]) -> dict:
        tokens = choices[0].tokens
        done = done_event(choices[0].completion)
        body = {"request_id": self.request_id, "text": choices[0].text,
                "token_ids": [t.token_id for t in tokens],
                **done.model_dump(exclude={"type", "text", "request_id"})}
        if any(t.logprob is not None for t in tokens):
            body["logprobs"] = [token_event(t).logprobs.model_dump() for t in tokens]
        return body


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = now()
    if state.draining:
        raise ApiError(503, "shutting_down", "the server is shutting down")
    body = await parse_body(request, GenerateRequest)
    params = sampling_params(body, body.logprobs)
    prompt_ids = (await state.engine.prompts.encode(body.prompt)
                  if isinstance(body.prompt, str) else list(body.prompt))
    request_id = caller_request_id(request, "gen")
    items = await state.engine.submit(request_id, [prompt_ids], params, arrival)
    return await respond(request, request_id, items, NativeRenderer(request_id), body.stream)
