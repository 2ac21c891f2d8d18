"""The aiohttp application: routes, JSON errors, health, metrics, graceful drain."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from aiohttp import web

from tritonserve.engine import InvalidRequestError, LLMEngine

from .async_engine import AsyncEngine
from .stream_hub import EngineDoor
from .streams import EngineUnavailableError, OverloadedError
from .chat_template import ChatTemplate
from .common import STATE, ApiError, ServerState, json_error
from .config import ServerConfig
from .embeddings_api import embeddings
from .messages_api import count_tokens, error_dialect, messages
from .metrics import Metrics
from .responses_api import add_routes as add_responses_routes
from .routes_cluster import add_routes as add_cluster_routes
from .routes_lora import add_routes as add_lora_routes
from .operators import api_key, cors
from .routes_native import generate
from .routes_openai import chat_completions, completions, models
from .routes_tokens import detokenize, tokenize, version
from .watchdog import Watchdog

log = logging.getLogger("tritonserve.server")


@web.middleware
async def json_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as exc:
        return json_error(exc.status, exc.code, exc.message, exc.param)
    except InvalidRequestError as exc:
        return json_error(400, "invalid_request", str(exc), exc.param)
    except OverloadedError as exc:
        return json_error(503, "overloaded", str(exc))
    except EngineUnavailableError as exc:
        return json_error(503, "engine_dead", str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(
            exc.status, "http_error")
        return json_error(exc.status, code, exc.reason)
    except ConnectionResetError:
        # The client hung up; the route's `finally` has aborted its request. An ordinary
        # event, not an error: no traceback. aiohttp fails to send this and closes quietly.
        log.info("client hung up during %s %s", request.method, request.path)
        return web.Response(status=499)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - never an HTML 500
        log.exception("unhandled error in %s", request.path)
        return json_error(500, "internal_error", f"{type(exc).__name__}: {exc}")


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine.dead is not None:
        return json_error(503, "engine_dead", f"the engine died: {state.engine.dead}")
    if state.draining:
        return json_error(503, "shutting_down", "the server is shutting down")
    body = {"status": "ok", "model": state.engine.card.name}
    views = state.engine.engines()
    if len(views) > 1:  # data-parallel: which engines serve (a dead one is out of rotation)
        body["engines"] = [{"index": v.index, "alive": v.alive, "pid": v.pid,
                            "running": v.stats.num_running, "waiting": v.stats.num_waiting,
                            "outstanding_tokens": v.outstanding_tokens} for v in views]
    return web.json_response(body)


PLAYGROUND = Path(__file__).parent / "static" / "playground.html"


async def playground(request: web.Request) -> web.Response:
    """GET /: the chat page (static; the API calls it makes carry the key the user types)."""
    return web.Response(body=PLAYGROUND.read_bytes(), content_type="text/html",
                        charset="utf-8")


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=state.metrics.render(),
                        headers={"Content-Type": state.metrics.content_type})


def build_app(engine: LLMEngine | EngineDoor, config: ServerConfig = ServerConfig(),
              engine_thread: bool = True) -> web.Application:
    """engine: an LLMEngine (hosted here by an AsyncEngine), or a host already built (the
    data-parallel front end, server/dp_engine.py). engine_thread=False leaves stepping the
    engine to the caller (AsyncEngine.run()). Bodies over config.max_body_bytes get 413
    before they are parsed."""
    async_engine = engine if isinstance(engine, EngineDoor) else AsyncEngine(
        engine, config.max_waiting, config.served_model_name)
    # outermost first: CORS headers on every answer (401s too), preflights before the key;
    # the Messages routes' errors in Anthropic's shape
    app = web.Application(middlewares=[cors, error_dialect, json_errors, api_key],
                          client_max_size=config.max_body_bytes)
    template = ChatTemplate.load(config.chat_template, async_engine.prompts.template_source,
                                 config.chat_template_timeout, config.reasoning_parser,
                                 config.tool_call_parser)
    app[STATE] = ServerState(engine=async_engine, metrics=Metrics(async_engine),
                             config=config, template=template)

    async def start_engine(app: web.Application) -> None:
        state = app[STATE]
        state.engine.bind_loop(asyncio.get_running_loop())
        if engine_thread:
            state.engine.start_thread()
        def stalled(why: str) -> None:
            if state.on_stall is not None:
                state.on_stall(why)

        state.watchdog = Watchdog(state.engine, state.config.step_timeout, stalled)
        state.watchdog.start()

    async def stop_engine(app: web.Application) -> None:
        app[STATE].watchdog.stop()
        app[STATE].engine.stop()

    app.on_startup.append(start_engine)
    app.on_cleanup.append(stop_engine)
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    add_responses_routes(app, config.responses_store)
    add_cluster_routes(app)
    add_lora_routes(app)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/", playground)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def drain(app: web.Application, grace_s: float) -> None:
    """Stop accepting, let running streams finish within the grace period, then end the
    rest with an error event."""
    state = app[STATE]
    state.draining = True
    deadline = asyncio.get_running_loop().time() + grace_s
    while state.engine.num_active and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if state.engine.num_active:
        state.engine.fail_all("shutting_down", f"the server shut down after a {grace_s:g} s "
                              "grace period")
        for _ in range(100):
            if not state.engine.num_active:
                break
            await asyncio.sleep(0.02)
