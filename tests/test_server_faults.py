"""No request harms another, over HTTP: each reproduction from the reliability probe gets the
right answer (a 4xx before any SSE byte, or a served stream) and its neighbours are unharmed."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import threading
import time

import aiohttp
import pytest

from tritonserve.engine import LLMEngine
from tritonserve.engine.llm import build_config
from tritonserve.server.common import STATE
from tests.server_util import ServerThread, metric, request, sse_payloads
from tests.test_server import validate_native

LONG = {"prompt": "keep going", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
        "stream": True}


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = ServerThread(LLMEngine(build_config(tiny_model, max_num_seqs=16)))
    yield srv
    srv.stop()


def wait_idle(srv, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and (srv.engine.has_unfinished_requests()
                                      or srv.app[STATE].engine.num_active):
        time.sleep(0.02)
    assert not srv.engine.has_unfinished_requests()
    assert srv.engine.kv_cache.num_used_blocks == 0


def with_neighbour(srv, body: dict, path: str = "/generate"):
    """Send `body` while a long greedy stream runs; return (status, raw, neighbour events)."""
    async def main():
        async with aiohttp.ClientSession() as session:
            neighbour = await session.post(srv.url + "/generate", json=LONG)
            first = await neighbour.content.readline()  # it is running
            async with session.post(srv.url + path, data=json.dumps(body)) as bad:
                status, raw = bad.status, await bad.read()
            events = sse_payloads(first + await neighbour.read())
            return status, raw, events

    status, raw, events = asyncio.run(main())
    neighbour = validate_native(events)
    assert neighbour[-1].type == "done" and neighbour[-1].output_tokens == LONG["max_tokens"]
    return status, raw


@pytest.mark.parametrize("top_k,expected", [
    ("18446744073709551616", 200), ("1099511627776", 200),  # past the vocabulary: off
    ("1e30", 400)])  # not an integer to the schema
def test_top_k_out_of_range_harms_no_neighbour(server, top_k, expected):
    """Each of these once failed the whole batch's step with 200 already sent."""
    body = ('{"prompt": "Hello", "max_tokens": 4, "stream": true, "top_k": ' + top_k + '}')
    status, raw = with_neighbour(server, json.loads(body))
    assert status == expected, raw
    if status == 200:
        assert validate_native(sse_payloads(raw))[-1].type == "done"
    else:
        assert json.loads(raw)["error"]["param"] == "top_k"
    wait_idle(server)


@pytest.mark.parametrize("route,body,param", [
    ("/generate", {"prompt": "\ud800 lone", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": ["\udfff"], "max_tokens": 2}, "stop.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udc00"}]},
     "messages.0.content"),
])
def test_lone_surrogates_get_400_naming_the_field(server, route, body, param):
    raw = json.dumps(body).encode()  # json escapes the surrogate as \\udxxx
    status, _, answer = request(server.port, "POST", route, raw)
    error = json.loads(answer)["error"]
    assert status == 400 and error["param"] == param, error


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_deep_nesting_gets_400(server, route):
    raw = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    status, _, answer = request(server.port, "POST", route, raw)
    assert status == 400 and json.loads(answer)["error"]["code"] == "invalid_json"


def test_body_over_the_limit_gets_413_at_once(server):
    raw = json.dumps({"prompt": "x" * (5 * 1024 * 1024)}).encode()
    started = time.perf_counter()
    status, _, answer = request(server.port, "POST", "/generate", raw)
    assert status == 413 and json.loads(answer)["error"]["code"] == "body_too_large"
    assert time.perf_counter() - started < 5


def test_a_huge_prompt_never_stalls_the_event_loop(tiny_model):
    """15 MB of prompt (under a raised body limit) is refused by its length before any
    tokenizer work, and /health answers within a second all the while."""
    srv = ServerThread(LLMEngine(build_config(tiny_model)), max_body_bytes=64 * 1024 * 1024)
    try:
        raw = json.dumps({"prompt": "word " * 3_000_000, "max_tokens": 2}).encode()
        answer: dict = {}

        def send():
            answer["status"], _, answer["body"] = request(srv.port, "POST", "/generate", raw)

        sender = threading.Thread(target=send)
        sender.start()
        worst = 0.0
        while sender.is_alive():
            started = time.perf_counter()
            status, _, _ = request(srv.port, "GET", "/health", timeout=5)
            worst = max(worst, time.perf_counter() - started)
            assert status == 200
        sender.join()
        assert answer["status"] == 400
        assert json.loads(answer["body"])["error"]["param"] == "prompt"
        assert worst < 1.0
    finally:
        srv.stop()


def hang_up_at_once(port: int, body: dict) -> None:
    """Send a whole request, then reset the connection (SO_LINGER 0) without reading."""
    data = json.dumps(body)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall((f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n{data}").encode())
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.mark.parametrize("stream", [True, False])
def test_instant_hang_ups_leak_nothing_and_log_no_error(server, caplog, stream):
    caplog.set_level(logging.INFO)
    for i in range(30):
        hang_up_at_once(server.port, {**LONG, "prompt": f"gone {i}", "max_tokens": 400,
                                      "stream": stream})
    time.sleep(0.5)
    wait_idle(server)
    assert metric(server.port, "tritonserve:kv_cache_usage_perc") == 0.0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    after = validate_native(sse_payloads(request(server.port, "POST", "/generate",
                                                 {**LONG, "max_tokens": 3})[2]))
    assert after[-1].type == "done"


def test_a_dead_engine_answers_503_everywhere(tiny_model, monkeypatch):
    engine = LLMEngine(build_config(tiny_model))
    srv = ServerThread(engine)
    try:
        def device_fault(schedule):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(engine.runner, "execute", device_fault)
        status, _, raw = request(srv.port, "POST", "/generate", LONG)
        events = validate_native(sse_payloads(raw))
        assert events[-1].type == "error" and events[-1].code == "engine_dead"
        status, _, raw = request(srv.port, "GET", "/health")
        assert status == 503 and json.loads(raw)["error"]["code"] == "engine_dead"
        status, _, raw = request(srv.port, "POST", "/v1/completions",
                                 {"prompt": "x", "max_tokens": 2})
        assert status == 503 and json.loads(raw)["error"]["code"] == "engine_dead"
    finally:
        srv.stop()
