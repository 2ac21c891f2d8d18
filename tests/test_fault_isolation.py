"""No request harms another inside the engine: a fault in one request's output processing
fails that request alone, a failed forward pass fails its batch and the next step goes on,
and only repeated or device faults kill the engine, without losing finished requests."""
from __future__ import annotations

import pytest

from tritonserve.engine import EngineDeadError, FinishReason, LLMEngine, SamplingParams
from tritonserve.engine.llm import build_config
from tritonserve.engine.llm_engine import MAX_FAILED_STEPS

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture()
def engine(tiny_model):
    return LLMEngine(build_config(tiny_model, max_num_seqs=8))


def drain(engine: LLMEngine) -> dict[str, list]:
    by_request: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for s in engine.step():
            by_request.setdefault(s.request_id, []).append(s)
    return by_request


class Exploding:
    """A detokenizer stand-in that fails on the first token it is given."""

    def add_token(self, token_id: int) -> str:
        raise RuntimeError("detokenizer fault")

    def flush(self) -> str:
        return ""


def test_an_output_fault_fails_that_request_alone(engine):
    finishing = engine.add_request("one two", SamplingParams(max_tokens=1, **GREEDY))
    bad = engine.add_request("three four", SamplingParams(max_tokens=5, **GREEDY))
    other = engine.add_request("five six", SamplingParams(max_tokens=5, **GREEDY))
    engine._requests[bad].detokenizer = Exploding()
    first = engine.step()  # all three prefill and sample together
    by_id = {s.request_id: s for s in first}
    assert by_id[finishing].completion.reason is FinishReason.LENGTH  # delivered, not lost
    assert by_id[bad].completion.reason is FinishReason.ERROR
    assert "detokenizer fault" in by_id[bad].completion.error
    assert by_id[other].completion is None and by_id[other].token.index == 0
    rest = drain(engine)
    assert set(rest) == {other}
    assert rest[other][-1].completion.reason is FinishReason.LENGTH
    assert engine.kv_cache.num_used_blocks == 0


def test_a_failed_forward_fails_its_batch_and_the_next_step_goes_on(engine, monkeypatch):
    first = engine.add_request("one two", SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    original = engine.runner.execute

    def failing(schedule):
        monkeypatch.setattr(engine.runner, "execute", original)
        raise RuntimeError("injected forward fault")

    monkeypatch.setattr(engine.runner, "execute", failing)
    steps = engine.step()
    assert [s.request_id for s in steps] == [first]
    assert steps[0].completion.reason is FinishReason.ERROR
    assert "injected forward fault" in steps[0].completion.error
    assert engine.kv_cache.num_used_blocks == 0
    later = engine.add_request("three four", SamplingParams(max_tokens=3, **GREEDY))
    done = drain(engine)[later][-1].completion
    assert done.reason is FinishReason.LENGTH and done.output_tokens == 3


def test_repeated_forward_failures_kill_the_engine(engine, monkeypatch):
    def failing(schedule):
        raise RuntimeError("always")

    monkeypatch.setattr(engine.runner, "execute", failing)
    for attempt in range(MAX_FAILED_STEPS - 1):
        engine.add_request(f"try {attempt}", SamplingParams(max_tokens=2, **GREEDY))
        assert engine.step()[0].completion.reason is FinishReason.ERROR
    engine.add_request("last", SamplingParams(max_tokens=2, **GREEDY))
    with pytest.raises(EngineDeadError, match="always"):
        engine.step()


def test_a_device_fault_kills_the_engine_and_keeps_earlier_steps(engine, monkeypatch):
    aborted = engine.add_request("one two", SamplingParams(max_tokens=4, **GREEDY))
    engine.add_request("three four", SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    engine.abort(aborted)

    def failing(schedule):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine.runner, "execute", failing)
    with pytest.raises(EngineDeadError) as info:
        engine.step()
    # the abort applied before the forward is delivered with the error
    assert [s.request_id for s in info.value.steps] == [aborted]
    assert info.value.steps[0].completion.reason is FinishReason.ABORT


def test_out_of_range_values_reach_no_step(engine):
    """top_k beyond the vocabulary (even past int64) is "off"; other requests unharmed."""
    huge = engine.add_request("one two", SamplingParams(max_tokens=3, top_k=2**64, seed=2**64 - 1))
    normal = engine.add_request("three four", SamplingParams(max_tokens=3, top_k=5, seed=1))
    done = {rid: steps[-1].completion for rid, steps in drain(engine).items()}
    assert done[huge].reason in (FinishReason.LENGTH, FinishReason.EOS)
    assert done[normal].reason in (FinishReason.LENGTH, FinishReason.EOS)
