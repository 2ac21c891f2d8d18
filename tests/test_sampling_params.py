import pytest

from engine import SamplingParams

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
]


@pytest.mark.parametrize("param,kwargs", INVALID)
def test_invalid_parameters_name_themselves(param, kwargs):
    with pytest.raises(ValueError, match=rf"^{param} must be"):
        SamplingParams(**kwargs)


def test_valid_parameters_normalise():
    p = SamplingParams(temperature=0, top_k=0, stop="###", logprobs=20, logit_bias={"7": -5})
    assert p.greedy and p.stop == ("###",) and p.logit_bias == {7: -5.0}
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[10**6]).check_vocab(1000)
