"""A pass-through HTTP proxy for a peer server that refuses what `vllm bench serve` sends:
llama-cpp-python's server answers 400 to any `x-request-id` that is not a UUID (its
starlette-context RequestIdPlugin validates it), and the bench sends `bench-<hex>-<n>`. The
proxy drops that header and streams everything else through unchanged, but for one addition:
that server sends no `usage` in a stream, so `vllm bench serve` counts a stream's tokens by
tokenizing its text again, which overcounts wherever the text does not tokenize back to the
tokens sampled (a padded vocabulary's `<unused_N>` tokens become five tokens each). Before the
`[DONE]` of a completions stream that carried no usage, the proxy sends one
`{"choices": [], "usage": {"completion_tokens": N}}`, N being the choice chunks before the
finishing one, an empty text included (that server streams one token a chunk: a 64-token
request streams 64).

python -m tritonserve.bench.peer_proxy --port 8201 --target http://127.0.0.1:8200
"""
from __future__ import annotations

import argparse
import json

import aiohttp
from aiohttp import web

DROPPED = {"x-request-id", "host", "content-length"}


class UsageCounter:
    """Passes SSE lines through, counting the data chunks with a choice's text; before
    `data: [DONE]` of a stream that sent no usage, a usage chunk with that count."""

    def __init__(self) -> None:
        self.chunks = 0
        self.saw_usage = False

    def feed(self, line: bytes) -> list[bytes]:
        body = line.strip()
        if body == b"data: [DONE]" and not self.saw_usage:
            usage = {"choices": [], "usage": {"completion_tokens": self.chunks}}
            return [b"data: " + json.dumps(usage).encode() + b"\n\n", line]
        if body.startswith(b"data: {"):
            try:
                data = json.loads(body[len(b"data: "):])
            except ValueError:
                return [line]
            self.saw_usage = self.saw_usage or bool(data.get("usage"))
            # a token is a choice chunk before the finishing one, its text "" included (a
            # token that ends inside a UTF-8 character: 2 of 64 on a padded vocabulary)
            self.chunks += sum(1 for c in data.get("choices") or ()
                               if c.get("finish_reason") is None
                               and ("text" in c or "content" in (c.get("delta") or {})))
        return [line]


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
            if "text/event-stream" not in upstream.headers.get("content-type", ""):
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            else:
                counter = UsageCounter()
                async for line in upstream.content:  # SSE: one line at a time
                    for out in counter.feed(line):
                        await response.write(out)
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
