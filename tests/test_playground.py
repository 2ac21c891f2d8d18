"""The playground page at `/` in a real headless Chromium (Debian's `chromium`; .ci/run
installs it when missing): the page lists the model, a prompt typed and sent streams a reply
from the embedded model, the reply's stats line (TTFT, tok/s) appears, and a screenshot of the
page is written to the test's tmp dir (docs/protocol.md, "Playground", says what it shows).
Chromium is driven over its DevTools protocol with aiohttp's websocket client."""
from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest

from tests.server_util import ServerThread, request

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") \
    or shutil.which("google-chrome")


def test_the_page_is_served_without_the_key(tiny_model):
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    srv = ServerThread(LLMEngine(build_config(tiny_model)), api_key="k")
    try:
        status, headers, raw = request(srv.port, "GET", "/")
        assert status == 200 and headers["content-type"].startswith("text/html")
        assert b"/v1/chat/completions" in raw and b"<script>" in raw
        assert not re.search(rb"""(src|href)=["']?(https?:)?//""", raw)  # no CDN
        assert request(srv.port, "GET", "/v1/models")[0] == 401  # the API still wants it
    finally:
        srv.stop()


class DevTools:
    """The few DevTools calls the test needs: evaluate an expression, take a screenshot."""

    def __init__(self, ws) -> None:
        self.ws, self._ids = ws, 0

    async def call(self, method: str, **params) -> dict:
        self._ids += 1
        await self.ws.send_json({"id": self._ids, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json(timeout=60)
            if message.get("id") == self._ids:
                if "error" in message:
                    raise RuntimeError(message["error"])
                return message["result"]

    async def js(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression,
                                 returnByValue=True, awaitPromise=True)
        return result["result"].get("value")

    async def until(self, expression: str, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = await self.js(expression)
            if value:
                return value
            await asyncio.sleep(0.2)
        raise AssertionError(f"timed out waiting for {expression}")


async def drive(url: str, profile: Path, shot: Path) -> dict:
    browser = subprocess.Popen(
        [BROWSER, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1100,760",
         url], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.monotonic() < deadline and browser.poll() is None, "no browser"
            await asyncio.sleep(0.1)
        port = port_file.read_text().split()[0]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json") as response:
                pages = [t for t in await response.json() if t["type"] == "page"]
            async with session.ws_connect(pages[0]["webSocketDebuggerUrl"],
                                          max_msg_size=0) as ws:
                tab = DevTools(ws)
                await tab.until("document.body && document.body.dataset.ready === '1'")
                model = await tab.js("document.getElementById('model').value")
                await tab.js("document.getElementById('temperature').value = '0';"
                             "document.getElementById('max_tokens').value = '24';"
                             "document.getElementById('prompt').value = 'What is the capital "
                             "of France?'; document.getElementById('send').click(); true")
                stats = await tab.until(
                    "(document.querySelector('.reply .stats') || {}).textContent")
                dom = await tab.js(json_of_dom)
                png = await tab.call("Page.captureScreenshot", format="png")
                import base64
                shot.write_bytes(base64.b64decode(png["data"]))
                return {"model": model, "stats": stats, **dom}
    finally:
        browser.kill()
        browser.wait(10)


json_of_dom = """JSON.parse(JSON.stringify({
  user: document.querySelector('.msg.user').textContent,
  reply: document.querySelector('.reply .content').textContent,
  errors: document.querySelectorAll('.reply .error').length}))"""


@pytest.mark.slow
@pytest.mark.skipif(BROWSER is None, reason="no chromium: `apt-get install chromium` "
                    "(.ci/run installs it) to run the playground in a browser")
def test_the_playground_streams_a_reply_in_chromium(smollm2_path, tmp_path):
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    srv = ServerThread(LLMEngine(build_config(smollm2_path)))
    try:
        shot = tmp_path / "playground.png"
        seen = asyncio.run(drive(srv.url + "/", tmp_path / "profile", shot))
        assert seen["model"] == Path(smollm2_path).name
        assert seen["user"] == "What is the capital of France?" and seen["errors"] == 0
        assert seen["reply"].strip(), seen  # SmolLM2 answered, streamed into the page
        assert "TTFT" in seen["stats"] and "tok/s" in seen["stats"]
        assert shot.stat().st_size > 10_000 and shot.read_bytes()[:4] == b"\x89PNG"
        print(json.dumps(seen), shot)
    finally:
        srv.stop()
