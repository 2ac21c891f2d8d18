"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob equals
transformers' log_softmax over the same forward, under chunked prefill, preemption and a warm
prefix cache; max_tokens=0 scores a prompt without sampling."""
from __future__ import annotations

import pytest
import torch

from tritonserve.engine import LLM, FinishReason, InvalidRequestError, SamplingParams
from tests.test_engine_parity import mixed_prompts


def hf_prompt_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row p is log P(. | ids[:p + 1])."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check_against_hf(model_dir, prompt, entries, top_n):
    ref = hf_prompt_logprobs(model_dir, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for p, entry in enumerate(entries[1:]):
        assert entry.token_id == prompt[p + 1]
        assert entry.logprob == pytest.approx(float(ref[p, prompt[p + 1]]), abs=2e-4)
        assert entry.rank == int((ref[p] > ref[p, prompt[p + 1]]).sum()) + 1
        assert len(entry.top_logprobs) == top_n
        if top_n:
            values, ids = ref[p].topk(top_n)
            assert entry.top_logprobs[0].token_id == int(ids[0])
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
                values.tolist(), abs=2e-4)


def test_prompt_logprobs_match_transformers(tiny_model):
    llm = LLM(tiny_model, dtype="float32")
    prompts = mixed_prompts(llm.tokenizer, count=4, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3,
                                                prompt_logprobs=2))
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 3
        check_against_hf(tiny_model, prompt, out.prompt_logprobs, 2)


def test_prompt_logprobs_chunked_and_preempted(tiny_model):
    """A prompt longer than the step's budget is scored chunk by chunk; a request preempted
    and recomputed reports each entry once."""
    llm = LLM(tiny_model, dtype="float32", max_num_batched_tokens=32, num_blocks=12)
    prompts = [p[:60] for p in mixed_prompts(llm.tokenizer, count=6, seed=2)]
    prompts[0] = (prompts[0] * 8)[:90]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20,
                                                prompt_logprobs=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        check_against_hf(tiny_model, prompt, out.prompt_logprobs, 0)
    assert llm.engine.scheduler.num_preemptions > 0, "the cache was big enough: no preemption"
    assert llm.engine.kv_cache.num_used_blocks == 0


def test_scoring_only_skips_the_prefix_cache(tiny_model):
    llm = LLM(tiny_model, dtype="float32")
    prompt = mixed_prompts(llm.tokenizer, count=1, seed=7, shared_prefix="a b c d " * 10)[0]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))  # warms the cache
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert out.finish_reason is FinishReason.LENGTH and out.token_ids == []
    check_against_hf(tiny_model, prompt, out.prompt_logprobs, 1)
    assert llm.engine.kv_cache.num_used_blocks == 0


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(max_tokens=0)
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(prompt_logprobs=21)
    assert err.value.param == "prompt_logprobs"


# ---- over HTTP: completions' echo + logprobs, max_tokens 0, vLLM's prompt_logprobs ---------
def test_echo_logprobs_score_the_prompt(client, server, tiny_model):
    prompt = server.engine.tokenizer.encode("the quick brown fox jumps over the lazy dog")
    ref = hf_prompt_logprobs(tiny_model, prompt)
    out = client.completions.create(model=server.engine.model_name, prompt=prompt, echo=True,
                                    logprobs=1, max_tokens=0, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    want = [float(ref[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=2e-4)
    piece = server.engine.tokenizer.decode
    for p, top in enumerate(lp.top_logprobs[1:]):
        best = int(ref[p].argmax())
        assert top[piece([best])] == pytest.approx(float(ref[p, best]), abs=2e-4)
        assert piece([prompt[p + 1]]) in top  # the prompt token itself, as vLLM's
    assert choice.text == server.engine.tokenizer.decode(prompt)


def test_echo_logprobs_stream_then_generate(client, server):
    prompt = "Paged attention stores keys"
    whole = client.completions.create(model=server.engine.model_name, prompt=prompt,
                                      echo=True, logprobs=0, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    lp = whole.choices[0].logprobs
    n_prompt = whole.usage.prompt_tokens
    assert len(lp.token_logprobs) == n_prompt + 3 and lp.token_logprobs[0] is None
    chunks = list(client.completions.create(model=server.engine.model_name, prompt=prompt,
                                            echo=True, logprobs=0, max_tokens=3,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)


def test_vllm_prompt_logprobs_field(server, tiny_model):
    from tests.server_util import request
    import json
    prompt = server.engine.tokenizer.encode("hello world this is a test")
    ref = hf_prompt_logprobs(tiny_model, prompt)
    status, _, raw = request(server.port, "POST", "/v1/completions", {
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2})
    assert status == 200, raw
    entries = json.loads(raw)["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    for p, entry in enumerate(entries[1:]):
        own = entry[str(prompt[p + 1])]
        assert own["logprob"] == pytest.approx(float(ref[p, prompt[p + 1]]), abs=2e-4)
        assert own["rank"] == int((ref[p] > ref[p, prompt[p + 1]]).sum()) + 1
        assert entry[str(int(ref[p].argmax()))]["rank"] == 1
    status, _, raw = request(server.port, "POST", "/v1/completions", {
        "prompt": prompt, "max_tokens": 0})
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"


def test_a_prompt_of_max_model_len_is_scored(tiny_model):
    llm = LLM(tiny_model, dtype="float32", max_model_len=64)
    prompt = (mixed_prompts(llm.tokenizer, count=1, seed=3)[0] * 20)[:64]
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    check_against_hf(tiny_model, prompt, out.prompt_logprobs, 0)
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([prompt], SamplingParams(max_tokens=1))
    assert err.value.param == "prompt"
