"""What an operator sets in front of the routes (server/operators.py): an API key, CORS, the
caller's X-Request-Id, and the names the model is served under."""
from __future__ import annotations

import json

import pytest

from tests.server_util import ServerThread, sse_payloads

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def guarded(tiny_model):
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    srv = ServerThread(LLMEngine(build_config(tiny_model)), api_key=KEY,
                       allowed_origins=("http://localhost:3000",),
                       served_model_name=("tiny", "tiny-alias"))
    yield srv
    srv.stop()


def _call(srv, path="/v1/completions", body=None, headers=None, method="POST"):
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    payload = None if body is None else json.dumps(body)
    conn.request(method, path, body=payload,
                 headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    return response.status, dict(response.getheaders()), response.read()


BODY = {"prompt": "hello", "max_tokens": 3, "temperature": 0}


def test_api_key_guards_the_routes_and_not_the_probes(guarded):
    status, headers, raw = _call(guarded, body=BODY)
    error = json.loads(raw)["error"]
    assert status == 401 and error["code"] == "invalid_api_key" and headers["WWW-Authenticate"]
    assert _call(guarded, body=BODY, headers={"Authorization": "Bearer wrong"})[0] == 401
    assert _call(guarded, body=BODY, headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    assert _call(guarded, body=BODY, headers={"X-Api-Key": KEY})[0] == 200
    for probe in ("/health", "/metrics", "/version"):  # open unless --auth-probes
        assert _call(guarded, probe, method="GET")[0] == 200, probe
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="tiny", prompt="hello", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="nope", max_retries=0) \
            .completions.create(model="tiny", prompt="hello", max_tokens=2)


def test_probes_can_be_guarded_too(tiny_model):
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    srv = ServerThread(LLMEngine(build_config(tiny_model)), api_key=KEY, auth_probes=True)
    try:
        assert _call(srv, "/health", method="GET")[0] == 401
        assert _call(srv, "/health", method="GET",
                     headers={"Authorization": f"Bearer {KEY}"})[0] == 200
    finally:
        srv.stop()


def test_cors_preflight_and_headers(guarded):
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers, _ = _call(guarded, "/v1/chat/completions", method="OPTIONS",
                               headers=preflight)  # no key: browsers send none here
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "Authorization" in headers["Access-Control-Allow-Headers"]
    status, headers, _ = _call(guarded, "/v1/chat/completions", method="OPTIONS",
                               headers={**preflight, "Origin": "http://evil.example"})
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = _call(guarded, body=BODY, headers={
        "Origin": "http://localhost:3000", "Authorization": f"Bearer {KEY}"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    status, headers, _ = _call(guarded, body=BODY, headers={"Origin": "http://localhost:3000"})
    assert status == 401 and headers["Access-Control-Allow-Origin"]  # the browser can read it


def test_x_request_id_round_trip(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    status, headers, raw = _call(guarded, body=BODY, headers={**auth, "X-Request-Id": "job-42"})
    assert status == 200 and headers["X-Request-Id"] == "job-42"
    assert json.loads(raw)["id"] == "job-42"
    status, headers, raw = _call(guarded, "/generate", body={**BODY, "stream": True},
                                 headers={**auth, "X-Request-Id": "job-43"})
    assert status == 200 and headers["X-Request-Id"] == "job-43"
    done = sse_payloads(raw)[-1]
    assert done["type"] == "done" and done["request_id"] == "job-43"
    status, headers, _ = _call(guarded, body=BODY, headers=auth)  # none given: one is made
    assert status == 200 and headers["X-Request-Id"].startswith("cmpl-")
    status, _, raw = _call(guarded, body=BODY, headers={**auth, "X-Request-Id": "bad id!"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "X-Request-Id"


def test_x_request_id_in_flight_is_refused(guarded):
    import threading
    import time

    from tritonserve.server.common import STATE
    auth = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "busy-1"}
    long = {"prompt": "hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    first = {}
    thread = threading.Thread(
        target=lambda: first.update(r=_call(guarded, "/generate", body=long, headers=auth)))
    thread.start()
    deadline = time.time() + 30
    while not guarded.app[STATE].engine.in_flight("busy-1") and time.time() < deadline:
        time.sleep(0.01)
    status, _, raw = _call(guarded, body=BODY, headers=auth)
    thread.join(60)
    assert status == 400 and "in flight" in json.loads(raw)["error"]["message"]
    assert first["r"][0] == 200
    assert _call(guarded, body=BODY, headers=auth)[0] == 200  # ended: the id is free again


def test_served_model_names(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, raw = _call(guarded, "/v1/models", method="GET", headers=auth)
    assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == ["tiny", "tiny-alias"]
    for name in ("tiny", "tiny-alias"):
        status, _, raw = _call(guarded, body={**BODY, "model": name}, headers=auth)
        assert status == 200 and json.loads(raw)["model"] == "tiny"
    status, _, raw = _call(guarded, body={**BODY, "model": guarded.engine.model_name},
                           headers=auth)  # aliases replace the folder's names
    assert status == 404 and json.loads(raw)["error"]["param"] == "model"


def test_cli_reads_the_operator_options(monkeypatch):
    from tritonserve.server.__main__ import parse_args, server_config
    monkeypatch.setenv("TRITONSERVE_API_KEY", "from-env")
    config = server_config(parse_args(["--allowed-origins", "http://a, http://b",
                                       "--served-model-name", "m1", "m2"]))
    assert config.api_key == "from-env" and config.allowed_origins == ("http://a", "http://b")
    assert config.served_model_name == ("m1", "m2") and not config.auth_probes
    assert server_config(parse_args(["--api-key", "k"])).api_key == "k"
    monkeypatch.delenv("TRITONSERVE_API_KEY")
    assert server_config(parse_args([])).api_key is None
