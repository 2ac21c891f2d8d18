import pytest

from tritonserve.engine import InvalidRequestError, SamplingParams

INVALID = [
    ("temperature", {"temperature": -0.5}),
    ("temperature", {"temperature": float("nan")}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -2}),
    ("min_p", {"min_p": 1.2}),
    ("logprobs", {"logprobs": 21}),
    ("max_tokens", {"max_tokens": 0}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 2}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -3}),
    ("stop", {"stop": ["ok", ""]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("seed", {"seed": -1}),
    ("logit_bias", {"logit_bias": {5: 101}}),
    ("max_tokens", {"max_tokens": 2.5}),
    # the ranges in which a step stays finite and every value fits its tensor
    ("temperature", {"temperature": 1e300}),
    ("repetition_penalty", {"repetition_penalty": 1e308}),
    ("repetition_penalty", {"repetition_penalty": 1e-300}),
    ("seed", {"seed": 2**64}),
    ("top_k", {"top_k": 1e30}),
]


@pytest.mark.parametrize("param,kwargs", INVALID)
def test_invalid_parameters_name_themselves(param, kwargs):
    with pytest.raises(InvalidRequestError, match=rf"^{param} must be") as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_valid_parameters_normalise():
    p = SamplingParams(temperature=0, top_k=0, stop="###", logprobs=20, logit_bias={"7": -5})
    assert p.greedy and p.stop == ("###",) and p.logit_bias == {7: -5.0}
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[10**6]).for_vocab(1000)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={2**64: 1.0}).for_vocab(1000)


def test_top_k_at_or_above_the_vocabulary_is_off():
    assert SamplingParams(top_k=2**64).for_vocab(1000).top_k == -1
    assert SamplingParams(top_k=1000).for_vocab(1000).top_k == -1
    assert SamplingParams(top_k=999).for_vocab(1000).top_k == 999


def test_tiny_temperatures_are_raised_to_the_floor():
    assert SamplingParams(temperature=1e-30).temperature == 1e-2
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def test_integer_numbers_are_stored_as_floats(tiny_model):
    """temperature=0 or 1 as ints (what a Python caller writes): stored as floats, so the
    sampler's temperature tensor is float32; an int reached the C++ draw as int64 and every
    step of the batch failed ("sample_softmax needs float32 temperature")."""
    from tritonserve.engine import LLM
    p = SamplingParams(temperature=1, top_p=1, min_p=0, repetition_penalty=1,
                       presence_penalty=0, frequency_penalty=0)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        assert type(getattr(p, name)) is float, name
    assert type(SamplingParams(temperature=0).temperature) is float
    llm = LLM(tiny_model, max_num_seqs=2)
    outs = llm.generate(["a b c", "d e f"], [SamplingParams(temperature=0, max_tokens=4),
                                             SamplingParams(temperature=1, max_tokens=4,
                                                            seed=3)])
    assert [o.error for o in outs] == [None, None]
    assert all(len(o.token_ids) >= 1 for o in outs)
