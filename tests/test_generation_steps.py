"""GenerationStep semantics: EOS and max-tokens termination never look alike."""
from __future__ import annotations

import pytest

from tritonserve.engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from tritonserve.engine.llm import build_config
from tests.tiny_models import eos_variant

PROMPT = "The quick brown fox"


def run_steps(engine: LLMEngine, prompt, params):
    request_id = engine.add_request(prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        steps.extend(s for s in engine.step() if s.request_id == request_id)
    return steps


@pytest.fixture(scope="module")
def greedy_tokens(tiny_model):
    engine = LLMEngine(build_config(tiny_model))
    steps = run_steps(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=12,
                                                     ignore_eos=True))
    return [s.token.token_id for s in steps]


@pytest.fixture(scope="module")
def eos_model(tiny_model, tmp_path_factory):
    """Same weights, but the EOS token is the one greedy decoding samples at index K."""
    return eos_variant(tiny_model, tmp_path_factory.mktemp("eos") / "m", PROMPT)


def test_eos_at_last_permitted_step(eos_model, greedy_tokens):
    folder, k = eos_model
    engine = LLMEngine(build_config(folder))
    steps = run_steps(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=k + 1))
    tokens = [s.token for s in steps if s.token is not None]
    assert [t.index for t in tokens] == list(range(k))
    assert [t.token_id for t in tokens] == greedy_tokens[:k]
    last = steps[-1]
    assert last.token is None, "EOS must not be delivered as a token"
    assert last.completion.reason is FinishReason.EOS
    assert last.completion.output_tokens == k
    assert sum(s.finished for s in steps) == 1


def test_max_tokens_ends_with_length_on_a_real_token(eos_model, greedy_tokens):
    folder, k = eos_model
    engine = LLMEngine(build_config(folder))
    steps = run_steps(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=k))
    last = steps[-1]
    assert last.token is not None and last.token.index == k - 1
    assert last.completion.reason is FinishReason.LENGTH
    assert last.completion.output_tokens == k
    assert [s.token.index for s in steps] == list(range(k))


def test_ignore_eos_runs_past_eos(eos_model):
    folder, k = eos_model
    engine = LLMEngine(build_config(folder))
    steps = run_steps(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=k + 3,
                                                     ignore_eos=True))
    assert steps[-1].completion.reason is FinishReason.LENGTH
    assert steps[-1].completion.output_tokens == k + 3


def test_empty_text_tokens_are_counted(tiny_model):
    engine = LLMEngine(build_config(tiny_model))
    special = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    steps = run_steps(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=5,
                                                     logit_bias={special: 100.0}))
    assert [s.token.token_id for s in steps] == [special] * 5
    assert [s.token.text for s in steps] == [""] * 5
    assert [s.token.index for s in steps] == list(range(5))
    assert steps[-1].completion.output_tokens == 5
    assert steps[-1].completion.reason is FinishReason.LENGTH


def test_stop_token_id_finishes_with_stop_and_no_token(tiny_model, greedy_tokens):
    engine = LLMEngine(build_config(tiny_model))
    stop_id = greedy_tokens[3]
    first = greedy_tokens.index(stop_id)
    steps = run_steps(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=12,
                                                     stop_token_ids=[stop_id]))
    assert steps[-1].token is None
    assert steps[-1].completion.reason is FinishReason.STOP
    assert steps[-1].completion.matched_stop == stop_id
    assert steps[-1].completion.output_tokens == first


def test_abort_between_steps_returns_blocks(tiny_model):
    engine = LLMEngine(build_config(tiny_model))
    keep = engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
    drop = engine.add_request(PROMPT + " jumps", SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()
    engine.abort(drop)
    steps = engine.step()
    aborted = [s for s in steps if s.request_id == drop]
    assert len(aborted) == 1 and aborted[0].completion.reason is FinishReason.ABORT
    while engine.has_unfinished_requests():
        for s in engine.step():
            assert s.request_id == keep
    assert engine.kv_cache.num_used_blocks == 0


def test_timing_is_ordered(tiny_model):
    engine = LLMEngine(build_config(tiny_model))
    steps = run_steps(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=3))
    t = steps[-1].completion.timing
    assert t.arrival <= t.first_scheduled <= t.first_token <= t.finish
    assert abs(t.queue_wait_s + t.execution_s - t.total_s) < 1e-9


def test_rejects_requests_that_can_never_run(tiny_model):
    from tritonserve.engine import InvalidRequestError
    engine = LLMEngine(EngineConfig(model=tiny_model,
                                    cache=build_config(num_blocks=4).cache))
    assert engine.max_model_len == 64  # capped by the 4-block cache
    with pytest.raises(InvalidRequestError, match="max_model_len 64"):
        engine.add_request("hello " * 40, SamplingParams(max_tokens=30))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request("hello", SamplingParams(max_tokens=600))
    with pytest.raises(InvalidRequestError, match="prompt"):
        engine.add_request([], SamplingParams())
    assert not engine.has_unfinished_requests()


def test_offline_generate_enqueues_nothing_when_one_prompt_is_invalid(tiny_model):
    from tritonserve.engine import LLM, InvalidRequestError
    llm = LLM(tiny_model)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate(["fine", "also fine", "too long"],
                     [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4),
                      SamplingParams(max_tokens=10_000)])
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["fine"], SamplingParams(max_tokens=3))[0].token_ids) <= 3


def test_min_tokens_suppresses_eos(eos_model):
    folder, k = eos_model
    engine = LLMEngine(build_config(folder))
    steps = run_steps(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=k + 6,
                                                     min_tokens=k + 3))
    assert steps[-1].completion.output_tokens >= k + 3
    eos = next(iter(engine.eos_token_ids))
    assert all(s.token.token_id not in engine.eos_token_ids for s in steps if s.token)
    assert eos not in [s.token.token_id for s in steps if s.token]


def test_special_tokens_are_text_when_not_skipped(tiny_model):
    engine = LLMEngine(build_config(tiny_model))
    special = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    steps = run_steps(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=2,
                                                     logit_bias={special: 100.0},
                                                     skip_special_tokens=False))
    assert "".join(s.token.text for s in steps) == "<|im_start|>" * 2


def test_min_tokens_holds_back_stop_strings(tiny_model):
    """A stop string counts only from the min_tokens-th token on, as EOS does."""
    engine = LLMEngine(build_config(tiny_model))
    free = run_steps(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True))
    stop = next(s.token.text for s in free if s.token.text.strip()).strip()
    early = run_steps(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=8,
                                                     ignore_eos=True, stop=[stop]))
    first = early[-1].completion.output_tokens
    assert early[-1].completion.reason is FinishReason.STOP
    late = run_steps(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=8,
                                                    ignore_eos=True, stop=[stop],
                                                    min_tokens=first + 2))
    assert late[-1].completion.output_tokens >= first + 2
    text = "".join(s.token.text for s in late if s.token) + late[-1].completion.tail_text
    assert stop in text  # the early occurrence was released, not matched


def test_logprobs_are_the_raw_distribution(tiny_model):
    """Logprobs are the model's, before logit_bias and penalties (vLLM's default)."""
    engine = LLMEngine(build_config(tiny_model))
    plain = run_steps(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=1,
                                                     logprobs=3, ignore_eos=True))[0].token
    biased = run_steps(engine, PROMPT, SamplingParams(
        temperature=0.0, max_tokens=1, logprobs=3, ignore_eos=True, repetition_penalty=3.0,
        logit_bias={plain.top_logprobs[1].token_id: 100.0}))[0].token
    assert biased.token_id == plain.top_logprobs[1].token_id  # the bias chose the token...
    assert biased.top_logprobs == plain.top_logprobs  # ...but the reported distribution is raw
    assert biased.logprob == pytest.approx(plain.top_logprobs[1].logprob)
