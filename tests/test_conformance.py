"""The conformance suite against the project's own server (it must pass) and against
deliberately broken servers (the right check must fail)."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest
from aiohttp import web

from tritonserve.bench import checks_openai
from tritonserve.bench.conformance import run_checks
from tritonserve.engine import LLMEngine
from tritonserve.engine.llm import build_config
from tests.fake_server import FakeServer
from tests.server_util import ServerThread
from tests.tiny_models import eos_variant


KEY = "conformance-key"


@pytest.fixture(scope="module")
def own_server(tiny_model, tmp_path_factory):
    """The tiny model, with EOS set to what greedy decoding samples K-th after "Hello"
    (the first probe prompt), so the EOS checks have something to find (same weights, the
    real engine path)."""
    folder, _ = eos_variant(tiny_model, tmp_path_factory.mktemp("conf") / "m", "Hello")
    srv = ServerThread(LLMEngine(build_config(folder)), api_key=KEY)
    yield srv
    srv.stop()


@pytest.mark.slow
@pytest.mark.parametrize("api", ["native", "openai", "agents"])
def test_own_server_passes(own_server, api):
    results = asyncio.run(run_checks(own_server.url, api, api_key=KEY))
    failed = [(r.name, r.evidence) for r in results if r.status == "fail"]
    assert not failed, failed
    skipped = [r.name for r in results if r.status == "skip"]
    # the tiny model has no thinking template: tests/test_chat_features.py runs that check
    assert skipped == (["openai_reasoning_fields"] if api == "openai" else []), skipped


def test_cli_exit_status_and_json(own_server, tmp_path):
    out = tmp_path / "conf.json"
    proc = subprocess.run([sys.executable, "-m", "tritonserve.bench", "conformance", "--base-url",
                           own_server.url, "--only", "plain_stream", "max_tokens_1",
                           "--api-key", KEY,
                           "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS  plain_stream" in proc.stdout
    assert [r["status"] for r in json.loads(out.read_text())] == ["pass", "pass"]


class FakeThread:
    def __init__(self, fault):
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.runner = web.AppRunner(FakeServer(fault).app)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(10)

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def failures(fault, api="native"):
    """The fake speaks the protocol and the OpenAI framing, not the OpenAI features (n,
    tools, ...): those checks run against the real server (test_own_server_passes)."""
    fake = FakeThread(fault)
    only = [c.__name__ for c in checks_openai.CHECKS] if api == "openai" else None
    try:
        results = asyncio.run(run_checks(fake.url, api, only=only))
    finally:
        fake.stop()
    return {r.name: r.evidence for r in results if r.status == "fail"}


def test_fault_free_fake_passes_everything():
    assert failures(None) == {}
    assert failures(None, "openai") == {}


# (fault, the check that must fail, a word its evidence must contain, isolated?)
FAULTS = [
    ("skipped_index", "plain_stream", "skipped", False),
    ("missing_done", "plain_stream", "without a terminal", False),
    ("count_mismatch", "output_tokens_match_events", "output_tokens", False),
    ("event_after_done", "plain_stream", "after the terminal", False),
    ("error_as_200_sse", "invalid_bodies", "HTTP 200", True),
    ("held_back_last_token", "length_counts_every_token", "held back", False),
]


@pytest.mark.parametrize("fault,check,evidence,isolated", FAULTS, ids=[f[0] for f in FAULTS])
def test_broken_server_fails_the_right_check(fault, check, evidence, isolated):
    failed = failures(fault)
    assert check in failed, f"{check} passed against a server with {fault}: {failed}"
    assert evidence in failed[check]
    if isolated:
        assert set(failed) == {check}


def test_missing_done_sentinel_fails_openai_framing_only_on_that_route():
    failed = failures("no_done_sentinel", "openai")
    assert "openai_completions_framing" in failed
    assert "[DONE]" in failed["openai_completions_framing"]
    assert failures("no_done_sentinel", "native") == {}


# ---- the Responses and Messages checks against replays of our own answers, broken ---------
def _recorded(own_server) -> dict:
    """(path, streamed) -> the raw body our server answers with."""
    from tests.server_util import request
    bodies = {"/v1/responses": {"input": "Say hello.", "max_output_tokens": 8,
                                "temperature": 0},
              "/v1/messages": {"max_tokens": 8, "temperature": 0,
                               "messages": [{"role": "user", "content": "Say hello."}]}}
    out = {}
    for path, body in bodies.items():
        for stream in (False, True):
            status, _, raw = request(own_server.port, "POST", path, {**body, "stream": stream},
                                     headers={"Authorization": f"Bearer {KEY}"})
            assert status == 200, raw
            out[path, stream] = raw
    return out


def _second_terminal(raw: bytes) -> bytes:
    frames = raw.split(b"\n\n")
    terminal = next(f for f in frames if f.startswith(b"event: response.completed")
                    or f.startswith(b"event: response.incomplete"))
    return raw + terminal + b"\n\n"


def _no_message_stop(raw: bytes) -> bytes:
    return b"\n\n".join(f for f in raw.split(b"\n\n") if b"message_stop" not in f)


AGENT_FAULTS = [(_second_terminal, "/v1/responses", "responses_stream_events", "terminal"),
                (_no_message_stop, "/v1/messages", "messages_stream_events", "message_stop")]


@pytest.mark.parametrize("mutate,path,check,evidence", AGENT_FAULTS,
                         ids=[f[2] for f in AGENT_FAULTS])
def test_broken_agent_streams_fail_the_right_check(own_server, mutate, path, check, evidence):
    recorded = _recorded(own_server)

    async def replay(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        if not isinstance(body.get("max_tokens", 8), int):  # the error-shape probe
            return web.json_response({"error": {"message": "bad"}}, status=400)
        raw = recorded[request.path, bool(body.get("stream"))]
        if body.get("stream") and request.path == path:
            raw = mutate(raw)
        return web.Response(body=raw, content_type="text/event-stream"
                            if body.get("stream") else "application/json")

    app = web.Application()
    app.router.add_post("/v1/responses", replay)
    app.router.add_post("/v1/messages", replay)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        results = loop.run_until_complete(run_checks(url, "agents"))
    finally:
        loop.run_until_complete(runner.cleanup())
        loop.close()
    failed = {r.name: r.evidence for r in results if r.status == "fail"}
    assert check in failed and evidence in failed[check], failed
    # the replay's error body is OpenAI's shape, not Anthropic's: that check fails too
    assert set(failed) == {check, "messages_error_shape"}, failed
