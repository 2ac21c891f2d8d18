"""The step watchdog (server/watchdog.py): a step that hangs past --step-timeout turns /health
to 503 with the reason, ends every open stream with an error event, and (the server's main)
ends the process with exit 1 for a supervisor."""
from __future__ import annotations

import json
import threading
import time

import pytest

from tests.server_util import ServerThread, request, sse_payloads
from tests.test_server_lifecycle import start_server

HANG_ON_FIRST_STEP = """
import sys, time
import tritonserve.engine.llm_engine as llm_engine
import tritonserve.server.__main__ as main

step = llm_engine.LLMEngine.step

def hanging(self):
    if self.has_unfinished_requests():
        time.sleep(3600)  # a deadlock, as the watchdog sees it
    return step(self)

llm_engine.LLMEngine.step = hanging
sys.exit(main.main(sys.argv[1:]))
"""


def test_a_hung_step_ends_the_streams_and_turns_health_503(tiny_model):
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    engine = LLMEngine(build_config(tiny_model))
    release = threading.Event()
    step = engine.step

    def hanging():
        if engine.has_unfinished_requests():
            release.wait(60)
        return step()

    engine.step = hanging
    srv = ServerThread(engine, step_timeout=1.0)
    try:
        assert request(srv.port, "GET", "/health")[0] == 200
        start = time.monotonic()
        status, _, raw = request(srv.port, "POST", "/generate", {
            "prompt": "hello", "max_tokens": 5, "stream": True})
        waited = time.monotonic() - start
        events = sse_payloads(raw)
        assert status == 200 and events[-1]["type"] == "error", events
        assert events[-1]["code"] == "engine_dead" and "watchdog" in events[-1]["message"]
        assert 1.0 <= waited < 10
        status, _, raw = request(srv.port, "GET", "/health")
        assert status == 503 and "watchdog" in json.loads(raw)["error"]["message"]
    finally:
        release.set()
        srv.stop()


def test_the_default_limit_follows_the_slowest_step():
    from tritonserve.server.watchdog import STALL_FACTOR, STEP_TIMEOUT_FLOOR, step_limit

    class Engine:
        slowest_step = 0.5

    assert step_limit(Engine, None) == STEP_TIMEOUT_FLOOR  # a short step: the floor
    Engine.slowest_step = 10.0  # a long prefill seen: a generous multiple of it
    assert step_limit(Engine, None) == STALL_FACTOR * 10.0
    assert step_limit(Engine, 2.5) == 2.5  # --step-timeout wins


@pytest.mark.slow
def test_the_server_process_exits_1_after_a_stall(tiny_model):
    proc, port = start_server(tiny_model, "--step-timeout", "2", program=("-c", HANG_ON_FIRST_STEP))
    try:
        status, _, raw = request(port, "POST", "/generate", {
            "prompt": "hello", "max_tokens": 5, "stream": True})
        assert status == 200 and sse_payloads(raw)[-1]["type"] == "error"
        assert proc.wait(timeout=30) == 1  # for a supervisor to restart it
    finally:
        if proc.poll() is None:
            proc.kill()
