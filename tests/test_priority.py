"""Priority (SamplingParams.priority, vLLM's meaning: lower runs first): the waiting queue is
ordered by it, a waiting request of higher priority preempts lower-priority running ones when
the cache is full or max_num_seqs run, the preempted finish with the tokens they would have
had, and equal priorities keep first-come-first-served."""
from __future__ import annotations

import json

import pytest

from tritonserve.engine import InvalidRequestError, LLMEngine, SamplingParams
from tritonserve.engine.llm import build_config

GREEDY = dict(temperature=0.0, ignore_eos=True)


def run(engine, until=lambda steps: False, limit=2000):
    """Steps until nothing runs (or `until` says so); -> {request: [token ids]}, the order
    requests got their first token."""
    tokens: dict[str, list[int]] = {}
    firsts: list[str] = []
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for step in engine.step():
            if step.token is not None:
                if step.request_id not in tokens:
                    firsts.append(step.request_id)
                tokens.setdefault(step.request_id, []).append(step.token.token_id)
        if until(firsts):
            break
    return tokens, firsts


def test_the_waiting_queue_runs_by_priority(tiny_model):
    engine = LLMEngine(build_config(tiny_model, max_num_seqs=1))
    ids = engine.tokenize("hello world")
    engine.add_request(ids, SamplingParams(max_tokens=3, **GREEDY), "first")
    engine.step()  # "first" runs; the one slot (max_num_seqs 1) is taken
    for name, priority in (("low", 5), ("high", -1), ("mid", 0), ("high-later", -1)):
        engine.add_request(ids, SamplingParams(max_tokens=3, priority=priority, **GREEDY),
                           name)
    _, firsts = run(engine)
    # high preempts first (it outranks it); first, back in the queue by its arrival, resumes
    # before mid (its first token came in the step above)
    assert firsts == ["high", "high-later", "first", "mid", "low"]
    assert engine.scheduler.num_preemptions == 1


def test_a_higher_priority_request_starts_at_once_under_a_full_cache(tiny_model):
    engine = LLMEngine(build_config(tiny_model, num_blocks=24))  # 384 tokens
    ids = engine.tokenize("paged attention keeps keys and values in blocks " * 3)
    for i in range(6):  # 6 x (prompt + 40): more than the cache holds at once
        engine.add_request(ids, SamplingParams(max_tokens=40, priority=1, **GREEDY), f"low{i}")
    run(engine, until=lambda firsts: engine.num_waiting > 0 and len(firsts) >= 3)
    assert engine.num_waiting > 0, "the cache held every low-priority request"
    free = engine.kv_cache.num_free_blocks * 16
    other = engine.tokenize("a different prompt that no cached block holds " * 12)
    long = other[:free + 40]  # more than the free blocks hold: room must be made
    engine.add_request(long, SamplingParams(max_tokens=5, priority=-5, **GREEDY), "urgent")
    steps = 0

    def started(firsts):
        nonlocal steps
        steps += 1
        return "urgent" in firsts

    run(engine, until=started)
    assert steps == 1, f"the urgent request waited {steps} steps for its first token"
    assert engine.scheduler.num_preemptions > 0
    run(engine)
    assert not engine.has_unfinished_requests() and engine.kv_cache.num_used_blocks == 0


def test_preempted_low_priority_outputs_are_unchanged(tiny_model):
    engine = LLMEngine(build_config(tiny_model, num_blocks=24))
    ids = engine.tokenize("the quick brown fox jumps over the lazy dog " * 2)
    alone = LLMEngine(build_config(tiny_model, num_blocks=64))
    alone.add_request(ids, SamplingParams(max_tokens=30, **GREEDY), "ref")
    reference = run(alone)[0]["ref"]
    for i in range(5):
        engine.add_request(ids, SamplingParams(max_tokens=30, priority=2, **GREEDY), f"low{i}")
    got, _ = run(engine, until=lambda firsts: len(firsts) >= 3)
    engine.add_request(ids, SamplingParams(max_tokens=30, priority=0, **GREEDY), "urgent")
    rest, _ = run(engine)
    for name, toks in rest.items():
        got.setdefault(name, []).extend(toks)
    assert engine.scheduler.num_preemptions > 0
    for name, toks in got.items():
        assert toks == reference, name


def test_priority_is_checked_and_reaches_the_server(server):
    from tests.server_util import request
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(priority=1 << 40)
    assert err.value.param == "priority"
    status, _, raw = request(server.port, "POST", "/v1/completions", {
        "prompt": "hi", "max_tokens": 2, "priority": -3})
    assert status == 200, raw
    status, _, raw = request(server.port, "POST", "/v1/completions", {
        "prompt": "hi", "max_tokens": 2, "priority": "high"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "priority"
