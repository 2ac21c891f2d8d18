"""What a router in front of N servers reads (sglang-router; docs/usage.md, "Behind a
router"): GET /get_load (its load balancing: the tokens each engine holds in its KV cache and
its requests), GET /model_info and /server_info (the model it registers the worker under),
POST /flush_cache (SGLang's; vLLM names it /reset_prefix_cache: the router forwards it to
every worker, benchmarks call it between runs).
/health, /v1/models and /metrics are the server's own. The router also adds SGLang's own
request fields at their defaults (routes_openai.ROUTER_DEFAULTS; vllm-router adds vLLM's).
"""
from __future__ import annotations

from aiohttp import web

from .common import STATE, ApiError
from .routes_tokens import server_version


async def get_load(request: web.Request) -> web.Response:
    """SGLang's shape: one entry per engine (data-parallel rank)."""
    state = request.app[STATE]
    card = state.engine.card
    blocks_per_engine = card.num_kv_blocks // max(card.engines, 1)
    return web.json_response([{
        "dp_rank": view.index,
        "num_reqs": view.stats.num_running + view.stats.num_waiting,
        "num_waiting_reqs": view.stats.num_waiting,
        "num_tokens": round(view.stats.kv_cache_usage * blocks_per_engine * card.block_size),
    } for view in state.engine.engines()])


async def model_info(request: web.Request) -> web.Response:
    """The served name where SGLang gives its model path: the server never shows its own
    paths (ModelCard.public_names)."""
    card = request.app[STATE].engine.card
    return web.json_response({"model_path": card.name, "served_model_name": card.name,
                              "is_generation": True, "max_model_len": card.max_model_len})


async def server_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = state.engine.card
    return web.json_response({
        "model_path": card.name, "served_model_name": card.name, "dp_size": card.engines, "max_model_len":
        card.max_model_len, "max_running_requests": None, "version": server_version(),
        "decode_plan": card.plan.as_dict()})


async def flush_cache(request: web.Request) -> web.Response:
    """The prefix cache forgotten; 400 while requests run (their blocks are the cache's:
    SGLang refuses then too), nothing forgotten."""
    if not await request.app[STATE].engine.reset_prefix_cache():
        raise ApiError(400, "cache_in_use", "the cache was not flushed: requests are "
                       "running; flush once they end")
    return web.json_response({"flushed": True})


def add_routes(app: web.Application) -> None:
    for path in ("/flush_cache", "/reset_prefix_cache"):
        app.router.add_post(path, flush_cache)
    for path, handler in (("/get_load", get_load), ("/model_info", model_info),
                          ("/get_model_info", model_info), ("/server_info", server_info),
                          ("/get_server_info", server_info)):
        app.router.add_get(path, handler)
