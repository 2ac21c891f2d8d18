"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's names and bodies): LoRA
adapters served from now on, or no more, without a restart. Off unless the server was started
with --allow-runtime-lora (the body names a folder the server reads); behind --api-key like
every route. An adapter in use is never unloaded under its requests: the call is refused.
"""
from __future__ import annotations

from aiohttp import web

from .common import STATE, ApiError, parse_body
from .schema import Strict


class LoadLoraRequest(Strict):
    lora_name: str
    lora_path: str


class UnloadLoraRequest(Strict):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name is what counts here


def _allowed(request: web.Request) -> None:
    if not request.app[STATE].config.allow_runtime_lora:
        raise ApiError(403, "runtime_lora_off", "loading adapters at run time is off: start "
                       "the server with --allow-runtime-lora")


async def load_lora_adapter(request: web.Request) -> web.Response:
    _allowed(request)
    body = await parse_body(request, LoadLoraRequest)
    await request.app[STATE].engine.load_lora(body.lora_name, body.lora_path)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    _allowed(request)
    body = await parse_body(request, UnloadLoraRequest)
    await request.app[STATE].engine.unload_lora(body.lora_name)
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
