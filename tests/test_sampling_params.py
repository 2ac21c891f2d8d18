import pytest

from engine import InvalidRequestError, SamplingParams

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
