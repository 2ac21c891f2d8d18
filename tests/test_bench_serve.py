"""tritonserve bench serve end to end against the project's server on the tiny model."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server_util import ServerThread


@pytest.fixture(scope="module")
def server(tiny_model):
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    srv = ServerThread(LLMEngine(build_config(tiny_model)))
    yield srv
    srv.stop()


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["native", "completions", "chat"])
def test_bench_serve_end_to_end(server, tiny_model, tmp_path, endpoint):
    result = tmp_path / "result.json"
    plot = tmp_path / "latency.png"
    cmd = [sys.executable, "-m", "tritonserve.bench", "serve", "--base-url", server.url,
           "--endpoint", endpoint, "--num-prompts", "12", "--max-concurrency", "4", "--input-len", "20",
           "--output-len", "10", "--tokenizer", tiny_model, "--seed", "3",
           "--goodput", "ttft:5000", "tpot:1000", "--result-json", str(result)]
    if endpoint == "native":
        cmd += ["--plot", str(plot)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(result.read_text())
    summary = data["summary"]
    assert summary["completed"] == 12 and summary["protocol_errors"] == 0
    assert summary["failed"] == 0
    for record in data["requests"]:
        assert record["protocol_error"] is None
        assert record["output_tokens"] == 10  # ignore_eos: exactly as asked
        assert record["client_output_tokens"] == record["output_tokens"] or endpoint == "chat"
    assert summary["total_output_tokens"] == 120
    assert summary["goodput"]["requests_per_s"] > 0
    assert "Output token throughput" in proc.stdout
    if endpoint == "native":
        assert plot.stat().st_size > 1000


def test_poisson_arrivals_are_repeatable():
    from tritonserve.bench.workload import arrival_gaps, random_requests
    assert arrival_gaps(5, 2.0, 7) == arrival_gaps(5, 2.0, 7)
    assert arrival_gaps(3, None, 7) == [0.0] * 3
    a = random_requests(3, 8, 4, seed=1)
    assert a == random_requests(3, 8, 4, seed=1) and len(a[0].prompt.split()) == 8


def test_shared_prefix_requests_reuse_their_system_prompts():
    from tritonserve.bench.workload import shared_prefix_requests
    requests = shared_prefix_requests(40, num_prefixes=3, prefix_len=12, input_len=4,
                                      output_len=5, seed=1)
    prefixes = {" ".join(r.prompt.split()[:12]) for r in requests}
    assert len(prefixes) == 3 and len({r.prompt for r in requests}) > 30
    assert all(r.input_len == 16 and r.output_len == 5 for r in requests)
    assert [r.prompt for r in requests] == [r.prompt for r in shared_prefix_requests(
        40, num_prefixes=3, prefix_len=12, input_len=4, output_len=5, seed=1)]


def test_a_model_list_is_taken_in_turn(monkeypatch):
    """--model a0,a1,a2 (LoRA adapters): request i names model i mod 3."""
    import argparse
    import asyncio

    from tritonserve.bench import serve
    from tritonserve.bench.workload import random_requests
    sent = []

    async def fake_send(session, base_url, endpoint, req, model, ignore_eos, sampling):
        sent.append((req.prompt, model))
        return None

    async def no_counters(session, base_url):
        return None

    monkeypatch.setattr(serve, "send", fake_send)
    monkeypatch.setattr(serve, "spec_counters", no_counters)
    monkeypatch.setattr(serve.Progress, "update", lambda self, record: None)
    requests = random_requests(7, 4, 2, seed=1)
    args = argparse.Namespace(request_rate=None, seed=0, max_concurrency=2, timeout=10,
                              base_url="http://unused", endpoint="completions",
                              model="a0,a1,a2", no_ignore_eos=False, temperature=None,
                              top_p=None)
    asyncio.run(serve.run(args, requests))
    assert sorted(sent) == sorted((r.prompt, f"a{i % 3}") for i, r in enumerate(requests))
