"""A real server on a free loopback port (in a background thread), and small HTTP helpers."""
from __future__ import annotations

import asyncio
import http.client
import json
import threading

from aiohttp import web

from tritonserve.server.app import build_app
from tritonserve.server.config import ServerConfig


class ServerThread:
    def __init__(self, engine, **server_options) -> None:
        """server_options: ServerConfig fields (max_waiting=1, max_body_bytes=...)."""
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.app = build_app(engine, ServerConfig(**server_options))
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.runner = web.AppRunner(self.app, handler_cancellation=True)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        fut = asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop)
        fut.result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def request(port: int, method: str, path: str, body=None, timeout: float = 120,
            headers: dict | None = None):
    """-> (status, headers dict, raw body bytes)"""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data,
                 headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    raw = response.read()
    headers = {k.lower(): v for k, v in response.getheaders()}
    conn.close()
    return response.status, headers, raw


def stream_until(port: int, path: str, body: dict, tokens: int, then) -> bytes:
    """Streams `body` (stream: true) and calls `then()` once `tokens` token events have
    arrived, then reads on to the end: an action mid-stream however fast the engine is (the
    tiny model streams 400 tokens in ~0.2 s). -> the raw body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode(),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    raw, seen = b"", 0
    while line := response.readline():
        raw += line
        payload = line[len(b"data: "):].strip() if line.startswith(b"data: ") else b""
        if payload.startswith(b"{") and json.loads(payload).get("type") == "token":
            seen += 1
            if seen == tokens:
                then()
    conn.close()
    return raw


def sse_payloads(raw: bytes) -> list:
    """Payloads of `data:` frames: dicts, or the string "[DONE]"."""
    out = []
    for frame in raw.decode().split("\n\n"):
        if not frame.strip():
            continue
        assert frame.startswith("data: "), f"bad SSE frame {frame!r}"
        data = frame[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(port: int, name: str) -> float:
    _, _, raw = request(port, "GET", "/metrics")
    total = 0.0
    found = False
    for line in raw.decode().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key = line.split(" ")[0]
            if key == name or key.startswith(name + "{"):
                total += float(line.split(" ")[-1])
                found = True
    assert found, f"metric {name} not exported"
    return total
