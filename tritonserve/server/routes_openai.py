"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models, and the
first steps every route shares (opened, started, check_model).

Their chunks are server/openai_render.py's. A list of prompts and `n` give len(prompts) x n
choices, index = prompt * n + j.
Structured output (response_format, vLLM's structured_outputs / guided_*) is enforced by a
grammar in the sampler (server/structured.py); tools and tool_choice by server/tools.py.
"""
from __future__ import annotations

from aiohttp import web

from .async_engine import now
from .common import STATE, ApiError, parse_body, sampling_params
from .operators import request_id as caller_request_id
from .driver import respond
from .openai_render import ChatRenderer, CompletionRenderer
from .schema import MAX_CHOICES, ChatCompletionRequest, CompletionRequest
from .structured import structured_output
from .chat_prepare import prepare_chat

# documented by OpenAI, not served yet: setting one is a 400 naming it (None / False is unset)
UNSUPPORTED = ("service_tier", "metadata", "suffix", "functions", "function_call", "audio",
               "modalities", "prediction", "web_search_options")
# SGLang's and vLLM's own fields, which sglang-router and vllm-router add to every body at
# these values (what this server does anyway); another value is a 400 naming the field
ROUTER_DEFAULTS = {"no_stop_trim": False, "return_hidden_states": False,
                   "continue_final_message": False, "separate_reasoning": True,
                   "stream_reasoning": True, "include_reasoning": True}


def check_model(state, model: str | None) -> None:
    card = state.engine.card
    if model is not None and model not in card.names() and model not in card.loras:
        raise ApiError(404, "model_not_found", f"model {model!r} is not served here; "
                       f"this server serves "
                       f"{' or '.join(map(repr, card.public_names() + card.loras))}", "model")


def lora_of(state, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names; None for the base (check_model first)."""
    return model if model is not None and model in state.engine.card.loras else None


def _check_supported(body, unsupported: tuple[str, ...]) -> None:
    for name, default in ROUTER_DEFAULTS.items():
        if getattr(body, name, None) not in (None, default):
            raise ApiError(400, "unsupported_parameter", f"{name} other than "
                           f"{str(default).lower()} is not supported by this server", name)
    for name in unsupported:
        if getattr(body, name, None) not in (None, False):
            raise ApiError(400, "unsupported_parameter",
                           f"{name} is not supported by this server yet", name)
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != body.n:
        raise ApiError(400, "unsupported_parameter", "best_of other than n is not supported",
                       "best_of")


def prompt_list(prompt) -> list:
    """A completions `prompt`: a string, token ids, or a list of either -> a list of prompts."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


async def opened(request: web.Request, schema, unsupported: tuple[str, ...] = UNSUPPORTED):
    """A route's first steps: the arrival time, the body parsed and checked (its model, the
    documented fields this server does not serve) -> (state, arrival, body)."""
    state, arrival = request.app[STATE], now()
    body = await parse_body(request, schema)
    check_model(state, body.model)
    _check_supported(body, unsupported)
    return state, arrival, body


async def completions(request: web.Request) -> web.StreamResponse:
    state, arrival, body = await opened(request, CompletionRequest)
    prompts = prompt_list(body.prompt)
    if len(prompts) * body.n > MAX_CHOICES:
        raise ApiError(400, "invalid_request", f"prompts x n must be at most {MAX_CHOICES}, got "
                       f"{len(prompts)} x {body.n}", "n")
    tokenizer = state.engine.prompts
    ids = []
    for i, prompt in enumerate(prompts):
        field = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        if isinstance(prompt, str):
            ids.append(await tokenizer.encode(prompt, field))
        elif not prompt:
            raise ApiError(400, "invalid_request", "must not be empty", field)
        else:
            ids.append(list(prompt))
    echo = None
    if body.echo:
        echo = [p if isinstance(p, str) else await tokenizer.decode(p) for p in prompts]
    scored = body  # echo with logprobs scores the prompt too (lm-eval's loglikelihoods)
    if body.echo and body.logprobs is not None:
        scored = body.model_copy(update={
            "prompt_logprobs": max(body.logprobs, body.prompt_logprobs or 0)})
    params = sampling_params(scored, body.logprobs, structured=structured_output(body))
    request_id = started(request, "cmpl")
    items = await state.engine.submit(request_id, ids, params, arrival, body.n,
                                      lora_of(state, body.model))
    renderer = CompletionRenderer(state, request_id, body, echo, ids)
    return await respond(request, request_id, items, renderer, body.stream)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state, arrival, body = await opened(request, ChatCompletionRequest)
    chat = await prepare_chat(state, body)
    request_id = started(request, "chatcmpl")
    items = await state.engine.submit(request_id, [chat.prompt_ids], chat.params, arrival,
                                      body.n, lora_of(state, body.model))
    renderer = ChatRenderer(state, request_id, body, chat.plan, len(chat.prompt_ids),
                            chat.prompt_text, chat.template.reasoning_parser)
    return await respond(request, request_id, items, renderer, body.stream)


def started(request: web.Request, prefix: str) -> str:
    """The request's id (the caller's X-Request-Id, else a new one), unless the server
    drains."""
    if request.app[STATE].draining:
        raise ApiError(503, "shutting_down", "the server is shutting down")
    return caller_request_id(request, prefix)


async def models(request: web.Request) -> web.Response:
    card = request.app[STATE].engine.card
    return web.json_response({"object": "list", "data": [{
        "id": name, "object": "model", "created": 0, "owned_by": "tritonserve",
        "root": card.name, "max_model_len": card.max_model_len}
        for name in card.public_names()] + [{
        "id": name, "object": "model", "created": 0, "owned_by": "tritonserve",
        "root": name, "parent": card.name, "max_model_len": card.max_model_len}
        for name in card.loras]})
