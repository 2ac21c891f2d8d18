"""Two servers behind the routers people deploy (sglang-router, vllm-router) on loopback: what
the router calls is answered (/health, /get_load, /model_info, the OpenAI, Responses,
embeddings and Messages routes with the fields each router adds), cache-aware routing sends a
shared prefix to one worker (more prefix-cache hits than round-robin), and a stopped worker is
routed around with no request lost."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.server_util import ServerThread, request

ROUTERS = ["sglang", "vllm"]


def _command(kind: str) -> list[str]:
    if kind == "sglang":
        pytest.importorskip("sglang_router")
        return [sys.executable, "-m", "sglang_router.launch_router"]
    binary = shutil.which("vllm-router") or shutil.which(
        "vllm-router", path=str(__import__("pathlib").Path(sys.executable).parent))
    if binary is None:
        pytest.skip("vllm-router is not installed")
    return [binary]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Router:
    def __init__(self, workers: list[str], policy: str, model: str = "m",
                 kind: str = "sglang") -> None:
        self.model = model
        # a port found free can be taken before the router binds it (a fresh-clone CI run
        # once lost that race: "Address already in use"): then it starts again on new ports
        for _ in range(3):
            if self._start(workers, policy, kind):
                return
        raise AssertionError("the router found no free port in 3 tries")

    def _start(self, workers: list[str], policy: str, kind: str) -> bool:
        """True once the router serves; False where its port was taken under it."""
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [*_command(kind), "--host", "127.0.0.1",
             "--port", str(self.port), "--prometheus-port", str(_free_port()),
             "--policy", policy, "--worker-urls", *workers, "--log-level", "error",
             "--health-check-interval-secs", "1", "--retry-max-retries", "3"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                status, _, raw = request(self.port, "GET", "/get_loads", timeout=5)
                loads = json.loads(raw).get("workers", []) if status == 200 else []
                # both registered (vllm-router reads {"load"} where /get_load gives
                # SGLang's list: it shows -1, unknown), and serving
                if len(loads) == len(workers) and self.complete("ready?")[0] == 200:
                    return True
            except OSError:
                pass
            if self.proc.poll() is not None:
                error = self.proc.stderr.read().decode()[-2000:]
                if "Address already in use" in error:
                    return False
                raise AssertionError(error)
            time.sleep(0.5)
        self.stop()
        raise AssertionError("the router did not register the workers in 60 s")

    def complete(self, prompt: str, max_tokens: int = 2) -> tuple[int, dict]:
        status, _, raw = request(self.port, "POST", "/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True})
        return status, json.loads(raw) if raw else {}

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def workers(tiny_model):
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    servers = [ServerThread(LLMEngine(build_config(tiny_model))) for _ in range(2)]
    yield servers
    for srv in servers:
        srv.stop()


def _hits(servers) -> list[int]:
    return [srv.engine.kv_cache.stats.hit_tokens for srv in servers]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ROUTERS)
def test_what_the_router_calls_is_answered(workers, kind):
    model = workers[0].engine.model_name
    router = Router([w.url for w in workers], "round_robin", model, kind)
    try:
        status, body = router.complete("hello there", 3)
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        status, _, raw = request(router.port, "POST", "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert status == 200, raw
        status, _, raw = request(router.port, "POST", "/v1/responses", {
            "model": model, "input": "hi", "max_output_tokens": 3})
        assert status == 200 and json.loads(raw)["object"] == "response", raw
        status, _, raw = request(router.port, "POST", "/v1/embeddings", {"model": model,
                                                                         "input": "hi"})
        assert status == 200 and len(json.loads(raw)["data"][0]["embedding"]) > 0
        if kind == "vllm":  # sglang-router 0.3 does not route /v1/messages
            status, _, raw = request(router.port, "POST", "/v1/messages", {
                "model": model, "max_tokens": 3,
                "messages": [{"role": "user", "content": "hi"}]})
            assert status == 200 and json.loads(raw)["type"] == "message", raw
        status, _, raw = request(workers[0].port, "GET", "/get_load")
        assert status == 200 and {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(
            json.loads(raw)[0])
        status, _, raw = request(workers[0].port, "GET", "/model_info")
        assert status == 200 and json.loads(raw)["model_path"] == workers[0].engine.model_name
    finally:
        router.stop()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ROUTERS)
def test_cache_aware_routing_keeps_a_prefix_on_one_worker(workers, kind):
    gained = {}
    for policy in ("round_robin", "cache_aware"):  # each with prefixes of its own
        prefixes = [f"{kind} {policy} document {k}: " + " ".join(f"w{k}x{i}" for i in range(60))
                    for k in range(4)]
        router = Router([w.url for w in workers], policy, workers[0].engine.model_name, kind)
        try:
            before = sum(_hits(workers))
            for prefix in prefixes:
                for j in range(4):
                    status, _ = router.complete(f"{prefix} [question {j}]")
                    assert status == 200
            gained[policy] = sum(_hits(workers)) - before
        finally:
            router.stop()
    # round-robin splits each prefix's four requests over both workers (each computes it
    # once); cache-aware sends all four to one (computed once, then three hits)
    assert gained["cache_aware"] > gained["round_robin"] > 0, gained


@pytest.mark.slow
def test_a_stopped_worker_is_routed_around(tiny_model):
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    servers = [ServerThread(LLMEngine(build_config(tiny_model))) for _ in range(2)]
    router = Router([s.url for s in servers], "round_robin", servers[0].engine.model_name)
    try:
        servers[1].stop()
        results = [router.complete(f"request {i}")[0] for i in range(8)]
        assert results == [200] * 8, results
    finally:
        router.stop()
        servers[0].stop()


@pytest.mark.parametrize("path", ["/flush_cache", "/reset_prefix_cache"])
def test_the_prefix_cache_is_flushed_when_nothing_runs(server, path):
    """SGLang's /flush_cache (a router forwards it to every worker) and vLLM's
    /reset_prefix_cache: a prompt seen before hits the cache, after a flush it does not; while a
    request runs the flush is refused (400) and that request streams on to its end."""
    from tests.server_util import sse_payloads, stream_until
    stats = server.engine.kv_cache.stats
    body = {"prompt": f"a prompt long enough to fill whole blocks {path} " * 6, "max_tokens": 2}

    def hits_of_one_more() -> int:
        before = stats.hit_tokens
        status, _, raw = request(server.port, "POST", "/v1/completions", body)
        assert status == 200, raw
        return stats.hit_tokens - before

    hits_of_one_more()
    assert hits_of_one_more() > 0  # the prompt's full blocks were cached
    status, _, raw = request(server.port, "POST", path)
    assert status == 200 and json.loads(raw) == {"flushed": True}, raw
    assert hits_of_one_more() == 0
    refused = []
    raw = stream_until(server.port, "/generate", {"prompt": "go on", "max_tokens": 60,
                                                  "ignore_eos": True}, 3,
                       lambda: refused.append(request(server.port, "POST", path)))
    status, _, error = refused[0]
    assert status == 400 and b"running" in error, error
    events = sse_payloads(raw)
    assert events[-1]["type"] == "done" and events[-1]["output_tokens"] == 60
