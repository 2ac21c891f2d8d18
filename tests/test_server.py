"""End-to-end tests of the HTTP server on a real loopback port with the tiny model."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import aiohttp
import pytest

from tritonserve.engine import LLMEngine
from tritonserve.engine.llm import build_config
from tritonserve.server.schema import STREAM_EVENT, StreamDoneEvent, StreamTokenEvent
from tests.server_util import ServerThread, metric, request, sse_payloads
from tests.tiny_models import eos_variant

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def eos_setup(tiny_model, tmp_path_factory):
    """The tiny model with EOS = the token greedy decoding samples at index K for PROMPT."""
    return eos_variant(tiny_model, tmp_path_factory.mktemp("srv") / "m", PROMPT)


@pytest.fixture(scope="module")
def server(eos_setup):
    folder, _ = eos_setup
    srv = ServerThread(LLMEngine(build_config(folder, max_num_seqs=48)))
    yield srv
    srv.stop()


def validate_native(payloads: list) -> list:
    """Every payload parses against the schema; indices contiguous from 0; exactly one
    terminal event, last; done.output_tokens equals the token events."""
    events = [STREAM_EVENT.validate_python(p) for p in payloads]
    tokens = [e for e in events if isinstance(e, StreamTokenEvent)]
    assert [t.index for t in tokens] == list(range(len(tokens)))
    terminals = [i for i, e in enumerate(events) if e.type != "token"]
    assert terminals == [len(events) - 1], "exactly one terminal event, and it is last"
    if isinstance(events[-1], StreamDoneEvent):
        done = events[-1]
        assert done.output_tokens == len(tokens)
        assert 0 <= done.ttft_ms <= done.total_ms
        assert abs(done.queue_wait_ms + done.execution_ms - done.total_ms) < 1.0
    return events


def stream(server, body, path="/generate"):
    status, headers, raw = request(server.port, "POST", path, {**body, "stream": True})
    assert status == 200, raw
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["x-request-id"]
    return sse_payloads(raw)


def test_stream_is_valid_event_by_event(server):
    events = validate_native(stream(server, {"prompt": "Hello world", "max_tokens": 7,
                                             "temperature": 0}))
    assert events[-1].finish_reason in ("length", "eos")


def test_eos_at_last_permitted_step_ends_with_eos(server, eos_setup):
    _, k = eos_setup
    events = validate_native(stream(server, {"prompt": PROMPT, "max_tokens": k + 1,
                                             "temperature": 0}))
    assert events[-1].finish_reason == "eos" and events[-1].output_tokens == k


def test_max_tokens_ends_with_length(server, eos_setup):
    _, k = eos_setup
    events = validate_native(stream(server, {"prompt": PROMPT, "max_tokens": k,
                                             "temperature": 0}))
    assert events[-1].finish_reason == "length" and events[-1].output_tokens == k


def test_forced_empty_text_token_is_an_event_and_counted(server):
    special = server.engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    events = validate_native(stream(server, {"prompt": PROMPT, "max_tokens": 4,
                                             "temperature": 0,
                                             "logit_bias": {str(special): 100}}))
    assert [e.text for e in events[:-1]] == [""] * 4
    assert events[-1].output_tokens == 4


def test_non_streaming_matches_streaming(server):
    body = {"prompt": "Paged attention", "max_tokens": 9, "temperature": 0}
    events = validate_native(stream(server, body))
    status, headers, raw = request(server.port, "POST", "/generate", body)
    result = json.loads(raw)
    assert status == 200 and headers["x-request-id"]
    assert result["token_ids"] == [e.token_id for e in events[:-1]]
    assert result["text"] == "".join(e.text for e in events[:-1]) + events[-1].text
    assert result["output_tokens"] == events[-1].output_tokens
    assert result["finish_reason"] == events[-1].finish_reason


def test_32_concurrent_streams_are_all_valid(server):
    async def one(session, i):
        body = {"prompt": f"request {i} says hello", "max_tokens": 5 + i % 7,
                "temperature": 0.8, "seed": i, "stream": True}
        async with session.post(server.url + "/generate", json=body) as resp:
            assert resp.status == 200
            return sse_payloads(await resp.read())

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(32)))

    for i, payloads in enumerate(asyncio.run(main())):
        events = validate_native(payloads)
        assert events[-1].type == "done"
        assert events[-1].output_tokens <= 5 + i % 7


BAD_BODIES = [
    (b"{not json", "invalid_json"),
    (json.dumps({"prompt": "hi", "bogus": 1}).encode(), "invalid_request"),
    (json.dumps({"prompt": "hi", "max_tokens": "many"}).encode(), "invalid_request"),
    (json.dumps({"prompt": "hi", "temperature": -1}).encode(), "invalid_request"),
    (json.dumps({"prompt": "hi", "top_p": 0}).encode(), "invalid_request"),
    (json.dumps({"prompt": "hi", "logprobs": 21}).encode(), "invalid_request"),
    (json.dumps({"prompt": ""}).encode(), "invalid_request"),
    (json.dumps({"prompt": "hi " * 400, "max_tokens": 200}).encode(), "invalid_request"),
    (json.dumps([1, 2]).encode(), "invalid_json"),
]


@pytest.mark.parametrize("raw,code", BAD_BODIES)
@pytest.mark.parametrize("streaming", [True, False])
def test_bad_requests_get_400_json_before_any_sse(server, raw, code, streaming):
    if streaming and raw.startswith(b"{\""):
        raw = json.dumps({**json.loads(raw), "stream": True}).encode()
    before = metric(server.port, "tritonserve:request_success_total")
    status, headers, body = request(server.port, "POST", "/generate", raw)
    assert status == 400
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["code"] == code and error["message"]
    assert not server.engine.has_unfinished_requests(), "nothing may be enqueued"
    assert metric(server.port, "tritonserve:request_success_total") == before


def test_error_names_the_parameter(server):
    status, _, body = request(server.port, "POST", "/generate",
                              {"prompt": "hi", "temperature": -1})
    assert status == 400 and json.loads(body)["error"]["param"] == "temperature"


def test_unknown_route_is_json_404(server):
    status, headers, body = request(server.port, "GET", "/nope")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"


def test_client_disconnect_aborts_and_returns_blocks(server):
    async def main():
        async with aiohttp.ClientSession() as session:
            survivor = asyncio.create_task(session.post(
                server.url + "/generate",
                json={"prompt": "keep going", "max_tokens": 150, "temperature": 0,
                      "ignore_eos": True, "stream": True}))
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            body = json.dumps({"prompt": "I will hang up", "max_tokens": 400,
                               "temperature": 0, "ignore_eos": True, "stream": True})
            writer.write((f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          f"application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                          f"{body}").encode())
            await writer.drain()
            seen = b""
            while seen.count(b"data: ") < 3:
                seen += await reader.read(1024)
            writer.close()
            resp = await survivor
            payloads = sse_payloads(await resp.read())
            return payloads

    payloads = asyncio.run(main())
    events = validate_native(payloads)
    assert events[-1].type == "done" and events[-1].output_tokens == 150
    deadline = time.time() + 10
    while time.time() < deadline and metric(server.port, "tritonserve:kv_cache_usage_perc"):
        time.sleep(0.05)
    assert metric(server.port, "tritonserve:kv_cache_usage_perc") == 0.0
    assert not server.engine.has_unfinished_requests()


def test_engine_exception_ends_streams_with_one_error_event(server, monkeypatch):
    runner = server.engine.runner
    original = runner.execute
    calls = {"n": 0}

    def failing(schedule):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return original(schedule)

    monkeypatch.setattr(runner, "execute", failing)
    payloads = stream(server, {"prompt": PROMPT, "max_tokens": 20, "temperature": 0,
                               "ignore_eos": True})
    events = validate_native(payloads)
    assert events[-1].type == "error" and events[-1].code == "engine_error"
    assert "injected fault" in events[-1].message
    assert len(events) == 3  # two tokens, then the error
    monkeypatch.setattr(runner, "execute", original)
    assert server.engine.kv_cache.num_used_blocks == 0
    after = validate_native(stream(server, {"prompt": PROMPT, "max_tokens": 3,
                                            "temperature": 0}))
    assert after[-1].type == "done"


def test_health_models_and_metrics(server):
    status, _, body = request(server.port, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, _, body = request(server.port, "GET", "/v1/models")
    assert json.loads(body)["data"][0]["id"] == server.engine.model_name
    stream(server, {"prompt": "count me", "max_tokens": 3, "temperature": 0})
    for name in ("tritonserve:time_to_first_token_seconds_count",
                 "tritonserve:request_time_per_output_token_seconds_count",
                 "tritonserve:request_queue_time_seconds_count",
                 "tritonserve:e2e_request_latency_seconds_count",
                 "tritonserve:num_requests_running", "tritonserve:num_requests_waiting",
                 "tritonserve:prompt_tokens_total", "tritonserve:generation_tokens_total"):
        assert metric(server.port, name) >= 0
    assert metric(server.port, "tritonserve:generation_tokens_total") >= 3
    # the same long prompt twice: the second finds its full blocks in the prefix cache
    prompt = "paged attention keeps keys and values in blocks " * 6
    before = {n: metric(server.port, f"tritonserve:prefix_cache_{n}_total")
              for n in ("queries", "hits")}
    for _ in range(2):
        stream(server, {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    queries = metric(server.port, "tritonserve:prefix_cache_queries_total") - before["queries"]
    hits = metric(server.port, "tritonserve:prefix_cache_hits_total") - before["hits"]
    assert queries >= 2 * 32 and 32 <= hits < queries and hits % 16 == 0, (queries, hits)
    assert metric(server.port, "tritonserve:num_preemptions_total") >= 0


def test_overload_gets_503_at_once(tiny_model):
    srv = ServerThread(LLMEngine(build_config(tiny_model, max_num_seqs=1)), max_waiting=1)
    try:
        async def main():
            async with aiohttp.ClientSession() as session:
                long = {"prompt": "busy", "max_tokens": 300, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                first = await session.post(srv.url + "/generate", json=long)
                await first.content.readline()  # running now
                second = asyncio.create_task(session.post(srv.url + "/generate", json=long))
                while srv.app and srv.engine.num_waiting < 1:
                    await asyncio.sleep(0.01)
                started = time.perf_counter()
                third = await session.post(srv.url + "/generate", json=long)
                elapsed = time.perf_counter() - started
                body = await third.json()
                first.close()
                (await second).close()
                return third.status, body, elapsed

        status, body, elapsed = asyncio.run(main())
        assert status == 503 and body["error"]["code"] == "overloaded"
        assert elapsed < 2.0
    finally:
        srv.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
