"""Tensor parallelism on torch.distributed (engine/parallel.py, engine/tp_runner.py), gloo on
the CPU with 2 processes: a tiny Llama with 4 query / 2 KV heads split in two gives tp=1's
log-probabilities within float tolerance and its greedy tokens, prefill and decode, fp32 and
bf16; what cannot split is refused naming the counts; a killed worker ends the server's
streams with an error event and turns /health to 503 within seconds."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tritonserve.engine import LLM, SamplingParams
from tritonserve.engine.parallel import local_arch
from tritonserve.engine.models import ModelArch
from tests.server_util import ServerThread, request, sse_payloads, stream_until
from tests.test_server import validate_native
from tests.tiny_models import write_tiny_model

HEADS = dict(num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tp-llama"), seed=6, **HEADS))


def run(model: str, dtype: str, tp: int, prompts, params, device: str = "cpu"):
    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=4, tensor_parallel_size=tp)
    try:
        return llm.generate(prompts, params), llm.engine.runner.plan
    finally:
        llm.engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 0.1)])
def test_two_ranks_give_one_ranks_logits_and_tokens(tp_model, dtype, tol, device):
    """Prompts of different lengths (prefill), then 12 decode steps a sequence, greedy: the
    tokens equal, each token's top-5 log-probabilities within tol (fp32: summation order of
    the all-reduce; bf16: its rounding of the partial sums)."""
    prompts = [[5 + i for i in range(n)] for n in (3, 9, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    one, _ = run(tp_model, dtype, 1, prompts, params, device)
    two, plan = run(tp_model, dtype, 2, prompts, params, device)  # 2 GPUs on CUDA (NCCL)
    assert plan.mode == "eager" and "tensor_parallel_size 2" in plan.why_mode
    for a, b in zip(one, two):
        assert a.token_ids == b.token_ids
        for ta, tb in zip(a.logprobs, b.logprobs):
            assert abs(ta.logprob - tb.logprob) < tol
            ours = {t.token_id: t.logprob for t in tb.top_logprobs}
            for t in ta.top_logprobs:
                if t.token_id in ours:
                    assert abs(ours[t.token_id] - t.logprob) < tol


def test_what_cannot_split_is_refused_naming_the_counts(tp_model):
    arch = ModelArch.from_folder(tp_model)
    assert (local_arch(arch, 2).num_heads, local_arch(arch, 2).num_kv_heads) == (2, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 must divide the model's KV "
                                         "heads 2 \\(query heads 4, KV heads 2\\)"):
        local_arch(arch, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide"):
        LLM(tp_model, dtype="float32", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(tp_model, tensor_parallel_size=0)


@pytest.fixture
def tp_server(tp_model):
    """A tp=2 engine (fp32) behind an in-process server, healthy; stopped after the test."""
    from tritonserve.engine import LLMEngine
    from tritonserve.engine.llm import build_config
    engine = LLMEngine(build_config(tp_model, dtype="float32", tensor_parallel_size=2))
    srv = ServerThread(engine)
    try:
        assert request(srv.port, "GET", "/health")[0] == 200
        yield engine, srv
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_worker_killed_mid_stream_ends_the_stream_and_health(tp_server):
    engine, srv = tp_server
    killed = []

    def kill_the_worker() -> None:
        killed.append(time.monotonic())
        os.kill(engine.runner.workers[0].pid, signal.SIGKILL)

    raw = stream_until(srv.port, "/generate", {"prompt": "x", "max_tokens": 500,
                                               "ignore_eos": True}, 3, kill_the_worker)
    assert killed and time.monotonic() - killed[0] < 10
    events = validate_native(sse_payloads(raw))
    assert any(e.type == "token" for e in events)  # it was streaming
    assert events[-1].type == "error" and events[-1].code == "engine_dead"
    status, _, raw = request(srv.port, "GET", "/health")
    assert status == 503 and "engine_dead" in raw.decode()


@pytest.mark.slow
def test_a_worker_killed_while_idle_turns_health_503(tp_server):
    engine, srv = tp_server
    os.kill(engine.runner.workers[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        status, _, raw = request(srv.port, "GET", "/health")
        if status == 503:
            break
        time.sleep(0.1)
    assert status == 503 and "worker rank 1 exited" in raw.decode()
    status, _, raw = request(srv.port, "POST", "/generate", {"prompt": "x", "max_tokens": 2})
    assert status == 503


@pytest.mark.slow
def test_torchrun_ranks_on_loopback(tp_model):
    """Multi-node through the same code: torchrun starts two processes (ranks) of the same
    server command on loopback; rank 0 serves HTTP, rank 1 runs the forward; the answer is
    tp=1's; SIGTERM to the server drains it and both ranks end with 0."""
    import shutil
    import subprocess
    import sys

    from tests.test_server import free_port

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    port, master = free_port(), free_port()
    proc = subprocess.Popen(
        [torchrun, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(master), "-m", "tritonserve.server", "--model", tp_model,
         "--port", str(port), "--tensor-parallel-size", "2", "--dtype", "float32"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        deadline, lines = time.time() + 120, []
        while time.time() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "READY" in line or proc.poll() is not None:
                break
        assert any("READY" in x for x in lines), "".join(lines[-20:])
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        status, _, raw = request(port, "POST", "/v1/completions", body)
        assert status == 200, raw
        import json
        served = json.loads(raw)["choices"][0]["text"]
        (one,), _ = run(tp_model, "float32", 1, [[5, 6, 7, 8]], SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True))
        assert served == one.text
        # SIGTERM to rank 0 alone (the server): it drains and stops rank 1; torchrun then
        # ends with both ranks' success (a signal to torchrun itself counts as a failure)
        ranks = {}
        for pid in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split():
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            ranks[next(e for e in env if e.startswith(b"RANK="))] = int(pid)
        os.kill(ranks[b"RANK=0"], signal.SIGTERM)
        code = proc.wait(timeout=60)
        assert code == 0, proc.stdout.read()[-4000:]  # torchrun names the rank that failed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
