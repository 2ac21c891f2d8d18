"""A pass-through HTTP proxy for a peer server that refuses what `vllm bench serve` sends:
llama-cpp-python's server answers 400 to any `x-request-id` that is not a UUID (its
starlette-context RequestIdPlugin validates it), and the bench sends `bench-<hex>-<n>`. The
proxy drops that header and streams everything else through unchanged.

python -m tritonserve.bench.peer_proxy --port 8201 --target http://127.0.0.1:8200
"""
from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

DROPPED = {"x-request-id", "host", "content-length"}


def make_app(target: str) -> web.Application:
    async def forward(request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED}
        session: aiohttp.ClientSession = request.app["session"]
        async with session.request(request.method, target + request.path_qs, headers=headers,
                                   data=await request.read()) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items()
                if k.lower() in ("content-type", "cache-control")})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def session(app: web.Application):
        app["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        yield
        await app["session"].close()

    app = web.Application()
    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(prog="peer_proxy")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--target", required=True)
    args = parser.parse_args()
    web.run_app(make_app(args.target.rstrip("/")), host="127.0.0.1", port=args.port,
                print=None)


if __name__ == "__main__":
    main()
