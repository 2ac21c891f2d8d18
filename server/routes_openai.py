"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

Streams are `data: {chunk}` frames ending with `data: [DONE]`. Exactly one chunk carries a
finish_reason (`stop` for EOS, a stop string or stop token; `length`); a failure sends
`data: {"error": ...}` with no finish_reason, then [DONE]. Usage is always in non-streaming
responses and, when stream_options.include_usage is set, in a last chunk with no choices.
"""
from __future__ import annotations

import time

from aiohttp import web

from engine import FinishReason

from .async_engine import now
from .common import (STATE, ApiError, error_body, failure_of, failure_response,
                     new_request_id, open_sse, parse_body, sampling_params, send_sse)
from .schema import ChatCompletionRequest, CompletionRequest

OPENAI_REASON = {FinishReason.EOS: "stop", FinishReason.STOP: "stop",
                 FinishReason.LENGTH: "length"}


def _check_model(state, model: str | None) -> None:
    if model is not None and model not in (state.model_name, str(state.engine.engine.model_path)):
        raise ApiError(404, "model_not_found", f"model {model!r} is not served here; "
                       f"this server serves {state.model_name!r}", "model")


def _usage(done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.output_tokens,
            "total_tokens": done.prompt_tokens + done.output_tokens}


class _Dialect:
    """What differs between the completion and chat framings."""

    def __init__(self, chat: bool, prompts, want_logprobs: bool) -> None:
        self.chat = chat
        self.prompts = prompts
        self.want_logprobs = want_logprobs
        self.object = "chat.completion" if chat else "text_completion"

    def logprobs(self, tokens) -> dict | None:
        if not self.want_logprobs or not tokens:
            return None
        piece = self.prompts.decode_token
        if self.chat:
            return {"content": [{"token": piece(t.token_id), "logprob": t.logprob,
                                 "top_logprobs": [{"token": piece(a.token_id),
                                                   "logprob": a.logprob}
                                                  for a in t.top_logprobs or ()]}
                                for t in tokens]}
        return {"tokens": [piece(t.token_id) for t in tokens],
                "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{piece(a.token_id): a.logprob for a in t.top_logprobs or ()}
                                 for t in tokens]}

    def chunk_choice(self, text: str, finish: str | None, tokens, first: bool) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else (
                {"content": text} if text or finish is None else {})
            return {"index": 0, "delta": delta, "logprobs": self.logprobs(tokens),
                    "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": self.logprobs(tokens),
                "finish_reason": finish}

    def full_choice(self, text: str, finish: str, tokens) -> dict:
        if self.chat:
            return {"index": 0, "message": {"role": "assistant", "content": text},
                    "logprobs": self.logprobs(tokens), "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": self.logprobs(tokens),
                "finish_reason": finish}


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = now()
    body = await parse_body(request, CompletionRequest)
    _check_model(state, body.model)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(400, "invalid_request", "only one prompt per request", "prompt")
        prompt = prompt[0]
    prompts = state.engine.prompts
    prompt_ids = await prompts.encode(prompt) if isinstance(prompt, str) else list(prompt)
    params = sampling_params(body, body.logprobs)
    dialect = _Dialect(False, prompts, body.logprobs is not None)
    return await _serve(request, state, arrival, prompt_ids, params, body, dialect, "cmpl")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = now()
    body = await parse_body(request, ChatCompletionRequest)
    _check_model(state, body.model)
    prompts = state.engine.prompts
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    prompt_ids = await prompts.encode_chat(messages)
    max_tokens = body.max_completion_tokens or (
        body.max_tokens if "max_tokens" in body.model_fields_set
        else max(1, state.engine.engine.max_model_len - len(prompt_ids)))
    top = body.top_logprobs if body.logprobs else None
    params = sampling_params(body, (top or 0) if body.logprobs else None, max_tokens)
    dialect = _Dialect(True, prompts, body.logprobs)
    return await _serve(request, state, arrival, prompt_ids, params, body, dialect, "chatcmpl")


async def _serve(request, state, arrival, prompt_ids, params, body, dialect, prefix):
    if state.draining:
        raise ApiError(503, "shutting_down", "the server is shutting down")
    request_id = new_request_id(prefix)
    items = state.engine.submit(request_id, prompt_ids, params, arrival)
    try:  # from here on, however the handler ends (a hang-up included), the request ends
        created = int(time.time())
        head = {"id": request_id, "created": created, "model": state.model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await _stream(request, state, items, head, dialect, include_usage)
        return await _collect(state, items, head, dialect)
    finally:
        items.close()


async def _stream(request, state, items, head, dialect, include_usage):
    response = await open_sse(request, head["id"])
    chunk_head = {**head, "object": dialect.object + ".chunk" if dialect.chat
                  else dialect.object}
    extra = {"usage": None} if include_usage else {}
    first = True
    async for item in items:
        failure = failure_of(item)
        if failure is not None:
            state.metrics.observe_failure(failure.code)
            await send_sse(response, error_body(failure.code, failure.message,
                                                kind="server_error"))
            break
        if item.token is not None:
            choice = dialect.chunk_choice(item.token.text, None, [item.token], first)
            await send_sse(response, {**chunk_head, "choices": [choice], **extra})
            first = False
        if item.completion is not None:
            done = item.completion
            state.metrics.observe_completion(done)
            choice = dialect.chunk_choice(done.tail_text, OPENAI_REASON[done.reason], [],
                                          first)
            await send_sse(response, {**chunk_head, "choices": [choice], **extra})
            if include_usage:
                await send_sse(response, {**chunk_head, "choices": [],
                                          "usage": _usage(done)})
    await send_sse(response, "[DONE]")
    await response.write_eof()
    return response


async def _collect(state, items, head, dialect):
    tokens = []
    async for item in items:
        failure = failure_of(item)
        if failure is not None:
            state.metrics.observe_failure(failure.code)
            return failure_response(failure, head["id"])
        if item.token is not None:
            tokens.append(item.token)
        if item.completion is not None:
            done = item.completion
            state.metrics.observe_completion(done)
            text = "".join(t.text for t in tokens) + done.tail_text
            choice = dialect.full_choice(text, OPENAI_REASON[done.reason], tokens)
            return web.json_response({**head, "object": dialect.object, "choices": [choice],
                                      "usage": _usage(done)},
                                     headers={"X-Request-Id": head["id"]})
    raise ApiError(500, "engine_error", "the request ended without a result")


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": 0, "owned_by": "tritonserve",
        "root": str(state.engine.engine.model_path),
        "max_model_len": state.engine.engine.max_model_len}]})
