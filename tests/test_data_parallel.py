"""Data parallelism (server/dp_engine.py, server/engine_process.py, server/router.py): engine
processes behind one front end. The router alone on made-up loads; the KV cache's journal that
feeds it; then two real engine processes behind the server: every stream valid under
concurrency, prefix routing keeps a shared prompt on the engine that holds it (more prefix-cache
hits than random routing on the same workload), per-engine /metrics beside the sums, a killed
engine ends only its own streams and leaves rotation, the last one turns /health 503, and
`tritonserve serve --data-parallel-size 2` starts and stops cleanly."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tritonserve.engine.kv_cache import KVCacheManager, prompt_digests
from tritonserve.server.router import BALANCE_TOKENS, NoEngineError, Router
from tests.test_kv_cache import make_request
from tests.server_util import ServerThread, metric, request, sse_payloads, stream_until
from tests.test_server import validate_native

BLOCK = 4


def held_by(router: Router, index: int, prompt: list[int]) -> None:
    router.journal(index, [(True, d) for d in prompt_digests(prompt, BLOCK)])


# ---- the router alone ----------------------------------------------------------------------
def test_prefix_routing_prefers_the_engine_holding_the_longest_prefix():
    router = Router(3, BLOCK)
    system = list(range(100, 116))  # 4 blocks
    held_by(router, 2, system[:8] + [1])  # engine 2 holds 2 blocks of it
    held_by(router, 1, system + [1])  # engine 1 holds all 4
    assert router.route("a", system + [7, 8, 9], max_tokens=10) == 1
    # cost: the 3 tokens past the held blocks + max_tokens
    assert router.engines[1].load == 3 + 10
    assert router.route("b", [5, 6, 7, 8, 9], max_tokens=4) == 0  # nothing held: least loaded


def test_a_burst_of_one_prefix_stays_together_until_the_balance_guard():
    router = Router(2, BLOCK)
    prompt = list(range(40))
    routed = [router.route(f"r{i}", prompt + [i], max_tokens=200) for i in range(3)]
    assert routed == [0, 0, 0]  # pending: counted as held before any prefill reports
    # past BALANCE_REL x the idle engine's load + BALANCE_TOKENS the least loaded takes it
    router.route("big", prompt + [99], max_tokens=BALANCE_TOKENS)
    assert router.route("next", prompt + [98], max_tokens=10) == 1


def test_ties_go_to_fewest_outstanding_tokens_and_streaming_pays_them_back():
    router = Router(2, BLOCK, policy="least-tokens")
    assert router.route("a", [1, 2, 3], max_tokens=50) == 0
    assert router.route("b", [1, 2, 3], max_tokens=10) == 1
    assert router.route("c", [1, 2, 3], max_tokens=10) == 1  # 13 < 53
    for _ in range(45):
        router.stepped("a", streamed=1, finished=False)
    assert router.engines[0].load == 3 + 5
    assert router.route("d", [1], max_tokens=1) == 0
    router.stepped("a", streamed=1, finished=True)
    router.forget("d")
    assert router.engines[0].load == 0 and router.engines[0].requests == 0


def test_choices_follow_their_first_and_dead_engines_leave_rotation():
    router = Router(2, BLOCK, policy="random", seed=3)
    first = router.route("x-0", [1, 2, 3], max_tokens=5)
    assert all(router.route(f"x-{j}", [1, 2, 3], 5, follow="x-0") == first for j in (1, 2))
    assert sorted(router.engine_died(first)) == ["x-0", "x-1", "x-2"]
    assert router.engines[first].load == 0
    assert {router.route(f"y{i}", [4], 1) for i in range(20)} == {1 - first}
    router.engine_died(1 - first)
    with pytest.raises(NoEngineError):
        router.route("z", [4], 1)


def test_random_routing_spreads_and_unknown_policies_are_refused():
    router = Router(2, BLOCK, policy="random", seed=0)
    assert {router.route(str(i), [1, 2, 3, 4, 5], 1) for i in range(30)} == {0, 1}
    with pytest.raises(ValueError, match="data_parallel_routing"):
        Router(2, BLOCK, policy="round-robin")


def test_the_journal_reports_what_enters_and_leaves_the_prefix_cache():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK, enable_prefix_caching=True)
    kv.journal = []
    a = make_request(0, list(range(9)), max_tokens=1)
    assert kv.allocate(a, 9)
    a.num_computed_tokens = 9
    kv.cache_full_blocks(a)
    digests = prompt_digests(list(range(9)) + [0], BLOCK)  # the 2 full blocks a lookup may hit
    assert a.block_hashes == digests
    assert kv.take_journal() == [(True, d) for d in digests] and kv.take_journal() == []
    kv.free(a)
    b = make_request(1, [50 + i for i in range(12)], max_tokens=1)
    assert kv.allocate(b, 12)  # takes the free blocks: the cached ones are evicted
    assert sorted(kv.take_journal()) == sorted((False, d) for d in digests)


# ---- two engine processes behind the server --------------------------------------------------
def front(model: str, routing: str = "prefix", **server_options):
    from tritonserve.engine.llm import build_config
    from tritonserve.server.dp_engine import DataParallelEngine
    engine = DataParallelEngine(build_config(model, dtype="float32",
                                             max_num_seqs=8), 2, routing)
    return engine, ServerThread(engine, **server_options)


@pytest.fixture(scope="module")
def dp(tiny_model):
    engine, srv = front(tiny_model)
    try:
        yield engine, srv
    finally:
        srv.stop()
        assert all(not e.process.is_alive() for e in engine._engines)


def generate(srv, body: dict) -> list:
    status, _, raw = request(srv.port, "POST", "/generate", {**body, "stream": True})
    assert status == 200, raw
    return validate_native(sse_payloads(raw))


@pytest.mark.slow
def test_concurrent_streams_are_valid_and_both_engines_serve(dp):
    engine, srv = dp
    results: list = [None] * 12

    def client(i: int) -> None:  # distinct prompts: nothing cached, least loaded
        results[i] = generate(srv, {"prompt": f"{i} " * (3 + i), "max_tokens": 6 + i,
                                    "ignore_eos": True})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None and r[-1].type == "done" and r[-1].output_tokens == 6 + i
               for i, r in enumerate(results))
    routed = [e.routed for e in engine.router.engines]
    assert min(routed) >= 3, routed
    assert all(e.load == 0 and e.requests == 0 for e in engine.router.engines)
    # per-engine families beside the sums
    queries = [metric(srv.port, f'tritonserve:engine_prefix_cache_queries_total{{engine="{i}"}}')
               for i in (0, 1)]
    assert min(queries) > 0
    assert metric(srv.port, "tritonserve:prefix_cache_queries_total") == sum(queries)
    assert metric(srv.port, "tritonserve:engine_alive") == 2


@pytest.mark.slow
def test_bad_requests_get_their_400_from_the_front_end(dp):
    _, srv = dp
    status, _, raw = request(srv.port, "POST", "/generate", {"prompt": "x", "max_tokens": 10**6})
    assert status == 400 and b"max_tokens" in raw
    status, _, raw = request(srv.port, "POST", "/v1/completions", {
        "prompt": "x", "max_tokens": 3, "n": 3, "temperature": 1.0})
    assert status == 200 and len(__import__("json").loads(raw)["choices"]) == 3


@pytest.mark.slow
def test_prefix_routing_finds_more_cached_prefixes_than_random(tiny_model):
    """4 long 'system prompts' x 4 questions, one at a time, on fresh engine pairs."""
    systems = [" ".join(f"s{k}w{j}" for j in range(40)) for k in range(4)]
    hits = {}
    for routing in ("prefix", "random"):
        engine, srv = front(tiny_model, routing)
        try:
            for q in range(4):
                for system in systems:
                    generate(srv, {"prompt": f"{system} question {q}", "max_tokens": 2})
            hits[routing] = (metric(srv.port, "tritonserve:prefix_cache_hits_total"),
                             metric(srv.port, "tritonserve:prefix_cache_queries_total"))
        finally:
            srv.stop()
    # prefix routing computes each system prompt once; random once on each engine it meets
    assert hits["prefix"][0] > hits["random"][0], hits
    assert hits["prefix"][1] == hits["random"][1]


@pytest.mark.slow
def test_a_killed_engine_ends_its_own_streams_and_leaves_rotation(tiny_model):
    engine, srv = front(tiny_model)
    try:
        results = {}

        def client(name: str, prompt: str) -> None:
            results[name] = generate(srv, {"prompt": prompt, "max_tokens": 400,
                                           "ignore_eos": True})

        def routed() -> int:
            return sum(engine.router.engines[i].requests for i in (0, 1))

        threads = [threading.Thread(target=client, args=(n, p))
                   for n, p in (("a", "one two three"), ("b", "four five six"))]
        for count, t in enumerate(threads, 1):
            t.start()
            deadline = time.monotonic() + 30  # "a" is counted before "b" is routed
            while routed() < count:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        owners = [engine.router.engines[i].requests for i in (0, 1)]
        assert owners == [1, 1], owners
        victim = engine._engines[0]
        os.kill(victim.pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
        ended = sorted(results, key=lambda n: results[n][-1].type)
        assert [results[n][-1].type for n in ended] == ["done", "error"]
        assert results[ended[1]][-1].code == "engine_dead"
        status, _, raw = request(srv.port, "GET", "/health")
        assert status == 200 and b'"alive": false' in raw
        assert metric(srv.port, "tritonserve:engine_alive") == 1
        for i in range(3):  # the other engine takes every new request
            assert generate(srv, {"prompt": f"after {i}", "max_tokens": 3})[-1].type == "done"
        os.kill(engine._engines[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while request(srv.port, "GET", "/health")[0] != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        status, _, raw = request(srv.port, "POST", "/generate", {"prompt": "x", "max_tokens": 2})
        assert status == 503 and b"engine_dead" in raw
    finally:
        srv.stop()


@pytest.mark.slow
def test_the_watchdog_takes_a_stuck_engine_out_and_the_other_serves_on(tiny_model):
    engine, srv = front(tiny_model, step_timeout=1.5)
    try:
        def stop_the_busy_one() -> None:  # a step that never ends, a few tokens in
            busy = [i for i in (0, 1) if engine.router.engines[i].requests]
            os.kill(engine._engines[busy[0]].pid, signal.SIGSTOP)

        events = validate_native(sse_payloads(stream_until(
            srv.port, "/generate", {"prompt": "a b c", "max_tokens": 400, "ignore_eos": True},
            3, stop_the_busy_one)))
        assert events[-1].type == "error" and events[-1].code == "engine_dead"
        assert request(srv.port, "GET", "/health")[0] == 200
        assert generate(srv, {"prompt": "still here", "max_tokens": 3})[-1].type == "done"
    finally:
        srv.stop()


@pytest.mark.slow
def test_serve_with_two_engines_starts_serves_and_stops(tiny_model):
    from tests.test_server_lifecycle import start_server
    proc, port = start_server(tiny_model, "--data-parallel-size", "2")
    try:
        assert "2 engines" in "".join(proc.startup_log)
        status, _, raw = request(port, "GET", "/health")
        assert status == 200 and raw.count(b'"alive": true') == 2
        pids = [e["pid"] for e in __import__("json").loads(raw)["engines"]]
        events = validate_native(sse_payloads(request(port, "POST", "/generate", {
            "prompt": "hi", "max_tokens": 4, "stream": True})[2]))
        assert events[-1].type == "done"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        for pid in pids:  # the engine processes went with it
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_engines_split_the_cpu_cache_budget_and_the_gpus(tiny_model):
    from tritonserve.engine.llm import build_config
    from tritonserve.engine.memory import cpu_cache_bytes
    from tritonserve.engine.resolve import resolved
    from tritonserve.server.dp_placement import devices_for, split_cache
    config = build_config(tiny_model, dtype="float32")
    _, arch, full, _ = resolved(config)
    assert split_cache(config, 2).cache.cache_bytes == cpu_cache_bytes(full, arch) // 2
    assert split_cache(build_config(tiny_model, num_blocks=64), 2).cache.cache_bytes is None
    assert devices_for(config, 1, 2) is None
    cuda = build_config(tiny_model, device="cuda", tensor_parallel_size=2)
    assert [devices_for(cuda, i, 2, count=4) for i in (0, 1)] == ["0,1", "2,3"]
    with pytest.raises(ValueError, match="needs 4 GPUs; this machine has 1"):
        devices_for(cuda, 0, 2, count=1)


@pytest.mark.slow
def test_each_engine_may_be_tensor_parallel(tmp_path):
    """dp 2 x tp 2 (six processes on loopback gloo): greedy tokens equal one engine's."""
    from tritonserve.engine import LLM, SamplingParams
    from tritonserve.engine.llm import build_config
    from tritonserve.server.dp_engine import DataParallelEngine
    from tests.tiny_models import write_tiny_model
    model = str(write_tiny_model(tmp_path / "tp", seed=6, num_attention_heads=4,
                                 num_key_value_heads=2))
    prompts = ["the cat sat", "a b c d e f"]
    llm = LLM(model, dtype="float32")
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6,
                                                                      temperature=0))]
    llm.engine.close()
    engine = DataParallelEngine(build_config(model, dtype="float32", tensor_parallel_size=2), 2,
                                routing="random")
    srv = ServerThread(engine)
    try:
        for prompt, tokens in zip(prompts, want):
            for _ in range(2):  # random routing: both engines, most likely
                events = generate(srv, {"prompt": prompt, "max_tokens": 6, "temperature": 0})
                assert [e.token_id for e in events[:-1]] == tokens
        assert all(e.process.is_alive() for e in engine._engines)
    finally:
        srv.stop()
