"""The streamed text of an output equals its in-context decode, decode(prompt + output) less
decode(prompt), for SentencePiece-style (Metaspace) and byte-level BPE tokenizers: the first
output token keeps its leading space."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonserve.engine import LLMEngine, SamplingParams
from tritonserve.engine.detokenizer import IncrementalDetokenizer
from tritonserve.engine.llm import build_config
from tritonserve.engine.llm_engine import PROMPT_DETOKENIZE_CONTEXT
from tests.tiny_models import write_tiny_model, write_tokenizer


@pytest.fixture(scope="module", params=["metaspace", "byte_level"])
def tokenizer(request, tmp_path_factory):
    from transformers import AutoTokenizer
    folder = tmp_path_factory.mktemp(request.param)
    write_tokenizer(folder, metaspace=request.param == "metaspace")
    return AutoTokenizer.from_pretrained(str(folder))


def in_context(tokenizer, prompt_ids, output_ids) -> str:
    whole = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True)
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    assert whole.startswith(prompt)
    return whole[len(prompt):]


def streamed(tokenizer, prompt_ids, output_ids) -> str:
    detok = IncrementalDetokenizer(tokenizer, True, prompt_ids[-PROMPT_DETOKENIZE_CONTEXT:])
    return "".join(detok.add_token(t) for t in output_ids) + detok.flush()


def test_first_output_word_keeps_its_space(tokenizer):
    prompt_ids = tokenizer.encode("The quick brown", add_special_tokens=False)
    # Metaspace marks the word start ("▁fox"); byte-level BPE carries the space in the token
    metaspace = tokenizer.backend_tokenizer.decoder.__class__.__name__ == "Metaspace"
    output_ids = tokenizer.encode("fox jumps" if metaspace else " fox jumps",
                                  add_special_tokens=False)
    expected = in_context(tokenizer, prompt_ids, output_ids)
    assert expected.startswith(" ")
    assert streamed(tokenizer, prompt_ids, output_ids) == expected


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(3, 383), min_size=1, max_size=8),
       output=st.lists(st.integers(3, 383), min_size=1, max_size=12))
def test_streamed_text_is_the_in_context_decode(tokenizer, prompt, output):
    vocab = len(tokenizer)
    prompt = [t % vocab for t in prompt]
    output = [t % vocab for t in output]
    if "\ufffd" in tokenizer.decode(prompt):
        return  # a prompt ending inside a character has no in-context text to compare with
    assert streamed(tokenizer, prompt, output) == in_context(tokenizer, prompt, output)


def test_engine_streams_the_leading_space_on_a_metaspace_model(tmp_path):
    folder = write_tiny_model(tmp_path / "m", metaspace=True)
    engine = LLMEngine(build_config(str(folder)))
    prompt_ids = engine.tokenizer.encode("The quick brown", add_special_tokens=False)
    rid = engine.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=8,
                                                        ignore_eos=True))
    pieces, output_ids = [], []
    while engine.has_unfinished_requests():
        for step in engine.step():
            if step.token is not None:
                pieces.append(step.token.text)
                output_ids.append(step.token.token_id)
            if step.completion is not None:
                assert step.request_id == rid
                pieces.append(step.completion.tail_text)
    assert "".join(pieces) == in_context(engine.tokenizer, prompt_ids, output_ids)
