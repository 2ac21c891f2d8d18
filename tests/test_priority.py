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


def _scheduled(engine, tokens: dict | None = None) -> dict[str, int]:
    """One step; -> {request id: tokens it computed} (from the scheduler's own output); the
    tokens drawn go to `tokens`."""
    scheduler, seen = engine.scheduler, {}
    schedule = scheduler.schedule
    try:
        def spy():
            out = schedule()
            seen.update({s.request.request_id: s.num_new_tokens for s in out.scheduled})
            return out
        scheduler.schedule = spy
        for step in engine.step():
            if step.token is not None and tokens is not None:
                tokens.setdefault(step.request_id, []).append(step.token.token_id)
    finally:
        scheduler.schedule = schedule
    return seen


def test_after_an_urgent_arrival_worse_rows_take_turns_within_the_cap(tiny_model):
    """priority_step_tokens: for the window after a priority -1 arrival, a step computes at
    most 4 tokens of worse priority, the least recently run first (each of 10 low streams
    decodes once in every 3 steps), and their outputs are those they have alone."""
    engine = LLMEngine(build_config(tiny_model, priority_step_tokens=4))
    ids = engine.tokenize("once upon a time in a small town")
    alone = LLMEngine(build_config(tiny_model))
    alone.add_request(ids, SamplingParams(max_tokens=24, **GREEDY), "ref")
    reference = run(alone)[0]["ref"]
    for i in range(10):
        engine.add_request(ids, SamplingParams(max_tokens=24, priority=3, **GREEDY), f"low{i}")
    got, _ = run(engine, until=lambda firsts: len(firsts) == 10)  # no cap yet: one step
    assert engine.scheduler.priority_step_tokens == 4
    urgent = engine.tokenize("a different question entirely")  # no cached prefix
    engine.add_request(urgent, SamplingParams(max_tokens=2, priority=-1, **GREEDY), "urgent")
    assert _scheduled(engine, got) == {"urgent": len(urgent)}  # the step admitting it: alone
    last_ran: dict[str, int] = {}
    for step in range(1, 13):
        seen = _scheduled(engine, got)
        low = {k: v for k, v in seen.items() if k.startswith("low")}
        assert sum(low.values()) <= 4 and len(low) == 4, seen
        for name in low:  # a turn each, in rotation: none runs twice within 3 steps
            assert step - last_ran.get(name, -9) >= 2, (name, step, last_ran)
            last_ran[name] = step
    assert set(last_ran) == {f"low{i}" for i in range(10)}
    rest, _ = run(engine)
    for name, toks in rest.items():
        got.setdefault(name, []).extend(toks)
    for i in range(10):
        assert got[f"low{i}"] == reference, i
    assert engine.kv_cache.num_used_blocks == 0


def test_no_cap_without_mixed_priorities_or_after_the_window(tiny_model):
    ids = list(range(5, 25))
    same = LLMEngine(build_config(tiny_model, priority_step_tokens=4))
    for i in range(10):  # one priority, if not 0: nothing is urgent against another
        same.add_request(ids, SamplingParams(max_tokens=5, priority=2, **GREEDY), f"r{i}")
    _scheduled(same)
    assert len(_scheduled(same)) == 10
    late = LLMEngine(build_config(tiny_model, priority_step_tokens=4, priority_window_s=0))
    late.add_request(ids, SamplingParams(max_tokens=2, priority=-1, **GREEDY), "urgent")
    for i in range(10):
        late.add_request(ids, SamplingParams(max_tokens=5, priority=2, **GREEDY), f"r{i}")
    assert len(_scheduled(late)) == 11  # the window is over at once: every row runs


def test_the_cap_is_the_cpus_by_default_and_checked():
    from tritonserve.engine.config import SchedulerConfig
    assert SchedulerConfig().step_tokens_under_priority("cpu") == 8
    assert SchedulerConfig().step_tokens_under_priority("cuda") is None
    assert SchedulerConfig(priority_step_tokens=32).step_tokens_under_priority("cuda") == 32
    with pytest.raises(ValueError, match="priority_step_tokens"):
        SchedulerConfig(priority_step_tokens=0)
    with pytest.raises(ValueError, match="priority_window_s"):
        SchedulerConfig(priority_window_s=-1)
