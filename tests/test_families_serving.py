"""Each family past Llama's served by the same paths as Llama: the OpenAI conformance suite
(/v1/chat/completions and /v1/completions streams, structured output, tool calls) against a
server on the family's tiny random checkpoint, and n-gram speculation giving the greedy tokens
of plain decoding (its verify rows run through the windowed attention)."""
from __future__ import annotations

import asyncio

import pytest

from tritonserve.bench.conformance import run_checks
from tritonserve.engine import LLM, LLMEngine, SamplingParams
from tritonserve.engine.llm import build_config
from tests.server_util import ServerThread
from tests.test_families_parity import FAMILIES
from tests.tiny_models import eos_variant, write_tiny_model

# proposals on every step they can (tests/test_speculative.py's settings)
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, ngram_min=1,
            speculative_min_acceptance=0.0)


# the tiny Gemma 2's tied head repeats the prompt's last token forever under greedy
# decoding (an embedding scaled by 8 dominates two layers), so it never samples an EOS to find
UNTIED = {"Gemma2ForCausalLM": dict(tie_word_embeddings=False)}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, str]:
    return {arch: str(write_tiny_model(tmp_path_factory.mktemp(arch), arch,
                                       **UNTIED.get(arch, {})))
            for arch in FAMILIES}


@pytest.mark.slow
@pytest.mark.parametrize("arch", FAMILIES)
def test_openai_conformance_per_family(family_models, arch, tmp_path):
    failed, skipped = conformance_failures(family_models[arch], tmp_path)
    assert not failed, failed
    assert skipped == ["openai_reasoning_fields"]


def conformance_failures(model: str, tmp_path) -> tuple[list, list[str]]:
    """The OpenAI conformance suite against a server on `model` (the plan auto picks):
    (failed checks with their evidence, skipped check names). EOS is set to what greedy
    decoding samples K-th after "Hello" (the first probe), so the EOS checks have something
    to find (tests/test_conformance.py does the same)."""
    folder, _ = eos_variant(model, tmp_path / "m", "Hello")
    server = ServerThread(LLMEngine(build_config(folder)), api_key="conformance-key")
    try:
        results = asyncio.run(run_checks(server.url, "openai", api_key="conformance-key"))
    finally:
        server.stop()
    return ([(r.name, r.evidence) for r in results if r.status == "fail"],
            [r.name for r in results if r.status == "skip"])


@pytest.mark.parametrize("arch", FAMILIES)
def test_ngram_speculation_keeps_greedy_tokens(family_models, arch):
    prompts = ["one two three four five one two three four five one two three",
               "the cat sat on the mat. the cat sat on the mat. the cat"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(family_models[arch], dtype="float32").generate(prompts, params)
    spec_llm = LLM(family_models[arch], dtype="float32", **SPEC)
    spec = spec_llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_llm.engine.spec_stats.proposed > 0  # verify rows ran (random models accept few)
