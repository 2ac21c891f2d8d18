"""`python -m tritonserve.server` as a real process: SIGTERM drains, then ends streams with an
error."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.server_util import request, sse_payloads
from tests.test_server import free_port, validate_native


# `python -m tritonserve.server` whose every forward pass hits a device fault (patched in
# before main)
DEVICE_FAULT = """
import sys
import tritonserve.engine.model_runner as runner

import tritonserve.server.__main__ as main

def execute(self, schedule):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

runner.ModelRunner.execute = execute
sys.exit(main.main(sys.argv[1:]))
"""


def start_server(model: str, *extra: str, program: tuple[str, ...] = ("-m", "tritonserve.server"),
                 ) -> tuple[subprocess.Popen, int]:
    """A server on its shipped defaults (the decode plan `auto` resolves), plus `extra`."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, *program, "--model", model, "--port",
                             str(port), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 120
    proc.startup_log = []  # the lines before READY
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("READY"):
            return proc, port
        proc.startup_log.append(line)
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError("server did not start")


@pytest.mark.slow
def test_sigterm_ends_streams_still_running_after_the_grace_period(tiny_model):
    import threading
    # one sequence at a time: the second stream cannot finish within the 0.05 s grace period
    # (the tiny model's 480 tokens took ~0.15 s a stream: with SIGTERM at 0.2 s and a 0.2 s
    # grace, both once finished in time)
    proc, port = start_server(tiny_model, "--grace-period", "0.05", "--max-num-seqs", "1")
    try:
        body = {"prompt": "long", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
                "stream": True}
        results = {}

        def client(name):
            results[name] = request(port, "POST", "/generate", body)

        threads = [threading.Thread(target=client, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        ends = []
        for name in ("a", "b"):
            status, _, raw = results[name]
            events = validate_native(sse_payloads(raw))
            ends.append(events[-1].type if events[-1].type == "done" else events[-1].code)
        assert "shutting_down" in ends, ends
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_sigterm_grace_period_lets_streams_complete(tiny_model):
    """On the shipped defaults: the decode step through the layer-stack op, nothing compiled
    at start-up."""
    proc, port = start_server(tiny_model, "--grace-period", "20")
    try:
        assert not any("decode compile" in line for line in proc.startup_log), proc.startup_log
        # the start-up line names the plan the `auto`s resolved to, with why (the tiny model
        # is fp32; CI builds the C++ library)
        assert any("serving" in line and "(float32; decode layers (auto on the CPU in "
                   "float32), weights panels, attention cpu, draw cpu; C++ CPU ops" in line
                   for line in proc.startup_log), proc.startup_log
        import threading
        results = {}

        def client():
            results["r"] = request(port, "POST", "/generate", {
                "prompt": "short", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                "stream": True})

        thread = threading.Thread(target=client)
        thread.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        thread.join(60)
        status, _, raw = results["r"]
        events = validate_native(sse_payloads(raw))
        assert events[-1].type == "done" and events[-1].output_tokens == 60
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_sigterm_exits_at_once_after_30_instant_hang_ups(tiny_model):
    """Hang-ups before the response headers abort their requests: nothing is left for the
    drain to wait for (it used to wait out the whole grace period)."""
    from tests.test_server_faults import hang_up_at_once
    proc, port = start_server(tiny_model, "--grace-period", "30")
    try:
        for i in range(30):
            hang_up_at_once(port, {"prompt": f"gone {i}", "max_tokens": 480,
                                   "temperature": 0, "ignore_eos": True, "stream": True})
        time.sleep(1.0)
        started = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.perf_counter() - started < 2.0
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_a_dead_engine_ends_its_streams_and_exits_1(tiny_model):
    proc, port = start_server(tiny_model, program=("-c", DEVICE_FAULT))
    try:
        status, _, raw = request(port, "POST", "/generate", {
            "prompt": "x", "max_tokens": 4, "stream": True})
        events = validate_native(sse_payloads(raw))
        assert events[-1].type == "error" and events[-1].code == "engine_dead"
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("extra,message", [
    (("--cache-bytes", str(1 << 50)), "cache_bytes"),
    (("--max-model-len", "0"), "max_model_len"),
    (("--max-model-len", "100000"), "max_position_embeddings"),
    (("--num-blocks", "4", "--max-model-len", "256"), "does not fit the KV cache"),
])
def test_bad_startup_option_exits_2_with_one_error_line(tiny_model, extra, message):
    done = subprocess.run([sys.executable, "-m", "tritonserve.server", "--model", tiny_model,
                           "--port", str(free_port()), *extra],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1].startswith("error: ")
    assert message in done.stderr and "Traceback" not in done.stderr


def test_missing_model_folder_exits_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tritonserve.server", "--model",
                           str(tmp_path / "none"), "--port", str(free_port())], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "error: " in done.stderr
