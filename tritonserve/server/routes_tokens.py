"""POST /tokenize, POST /detokenize, GET /version (vLLM's shapes)."""
from __future__ import annotations

from importlib import metadata

from aiohttp import web

from .common import STATE, ApiError, check_chat_size, parse_body
from .routes_openai import check_model
from .schema import DetokenizeRequest, TokenizeRequest


def server_version() -> str:
    try:
        return metadata.version("tritonserve")
    except metadata.PackageNotFoundError:  # run from a checkout without installing
        return "0+unknown"


async def tokenize(request: web.Request) -> web.Response:
    """{"prompt": text} or {"messages": [...]} (through the chat template) -> token ids."""
    state = request.app[STATE]
    body = await parse_body(request, TokenizeRequest)
    check_model(state, body.model)
    prompts = state.engine.prompts
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "invalid_request", "give exactly one of prompt and messages",
                       "prompt")
    if body.prompt is not None:
        tokens = await prompts.encode(body.prompt, "prompt", body.add_special_tokens)
    else:
        check_chat_size(body.messages, None, state.engine.limits)
        kwargs = state.template.kwargs_for(body.chat_template_kwargs, None)
        tokens, _ = await prompts.encode_chat([m.for_template() for m in body.messages], None,
                                              state.template, kwargs)
    return web.json_response({"count": len(tokens), "max_model_len":
                              state.engine.card.max_model_len, "tokens": tokens})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await parse_body(request, DetokenizeRequest)
    check_model(state, body.model)
    vocab = state.engine.card.vocab_size
    if any(t < 0 or t >= vocab for t in body.tokens):
        raise ApiError(400, "invalid_request", f"token ids must be in [0, {vocab})", "tokens")
    return web.json_response({"prompt": await state.engine.prompts.decode(body.tokens)})


async def version(request: web.Request) -> web.Response:
    """vLLM's {"version"}, and the decode plan this server runs (engine/plan.py)."""
    return web.json_response({"version": server_version(),
                              "decode_plan": request.app[STATE].engine.card.plan.as_dict()})
