"""The engine end to end through the Triton kernels (interpreted on the CPU here)."""
from __future__ import annotations

import pytest

from tritonserve.engine import LLM, FinishReason, SamplingParams

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "def main():",
           "Paged attention stores keys and values in fixed-size blocks. " * 2]


@pytest.mark.slow
def test_triton_path_gives_the_torch_path_greedy_tokens(tiny_model):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    torch_out = LLM(tiny_model, attention_backend="torch").generate(PROMPTS, params)
    # a small token budget makes the Triton run mix chunked prefill with decodes
    triton_llm = LLM(tiny_model, attention_backend="triton", sampler_backend="triton",
                     max_num_batched_tokens=24)
    assert triton_llm.engine.runner.backend.name == "triton"
    triton_out = triton_llm.generate(PROMPTS, params)
    assert [o.token_ids for o in triton_out] == [o.token_ids for o in torch_out]


def test_stop_string_end_to_end(tiny_model):
    llm = LLM(tiny_model)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    full = llm.generate(["The quick brown fox"], params)[0]
    printable = [i for i in range(2, len(full.text) - 3)
                 if full.text[i:i + 3].isprintable() and "\ufffd" not in full.text[i:i + 3]]
    if not printable:
        pytest.skip("greedy output of the random model has no printable span")
    start = printable[0]
    stop = full.text[start:start + 3]
    first = full.text.find(stop)
    out = llm.generate(["The quick brown fox"],
                       SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                      stop=[stop]))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == full.text[:first]
    assert out.token_ids == full.token_ids[:len(out.token_ids)]


@pytest.mark.slow
def test_triton_path_takes_windows_and_softcaps(tmp_path):
    """A tiny Gemma 2 (windows of 8 in every other layer, attention soft-caps) through the
    Triton kernels' WINDOWED / SOFTCAPPED variants, prompts past the window, chunked prefill
    mixed with decodes: the torch path's greedy tokens."""
    from tests.tiny_models import write_tiny_model
    folder = str(write_tiny_model(tmp_path / "gemma2", "Gemma2ForCausalLM",
                                  tie_word_embeddings=False))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    torch_out = LLM(folder, attention_backend="torch", dtype="float32").generate(PROMPTS,
                                                                                  params)
    triton_llm = LLM(folder, attention_backend="triton", max_num_batched_tokens=24,
                     dtype="float32")
    assert triton_llm.engine.runner.backend.name == "triton"
    triton_out = triton_llm.generate(PROMPTS, params)
    assert [o.token_ids for o in triton_out] == [o.token_ids for o in torch_out]
