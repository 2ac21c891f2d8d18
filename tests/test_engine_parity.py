"""Greedy output token-identical to transformers generate (fp32, CPU), batched, for every
architecture, and under preemption, prefix caching and chunked prefill."""
from __future__ import annotations

import random

import pytest

from tritonserve.engine import LLM, SamplingParams
from tests.parity import TIE_GAP_BF16, assert_parity, hf_greedy


def mixed_prompts(tokenizer, count=8, seed=0, shared_prefix=""):
    rng = random.Random(seed)
    words = ("paged attention block token stream the quick brown fox schedule cache "
             "hello world emoji 😀 你好 café").split()
    prompts = []
    for i in range(count):
        n = rng.choice([1, 3, 8, 20, 40, 70])
        prompts.append(shared_prefix + " ".join(rng.choice(words) for _ in range(n)))
    return [tokenizer.encode(p) for p in prompts]


def run_and_compare(model_dir, prompts, max_tokens=16, **options):
    llm = LLM(model_dir, **options)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    refs = hf_greedy(model_dir, prompts, max_tokens, set(llm.engine.eos_token_ids))
    assert_parity([o.token_ids for o in outs], refs)
    return llm


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM",
                                  "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_parity_each_architecture(tiny_models, arch):
    llm = LLM(tiny_models[arch])
    prompts = mixed_prompts(llm.tokenizer)
    run_and_compare(tiny_models[arch], prompts)


def test_llama3_rope_scaling_and_tied_embeddings(tmp_path):
    from tests.tiny_models import write_tiny_model
    folder = write_tiny_model(tmp_path / "llama3", tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, rope_theta=500000.0)
    llm = LLM(str(folder))
    run_and_compare(str(folder), mixed_prompts(llm.tokenizer, seed=3), max_tokens=24)


def test_parity_under_preemption(tiny_model):
    llm = LLM(tiny_model)
    prompts = mixed_prompts(llm.tokenizer, seed=1)
    # 24 blocks of 16 tokens cannot hold 8 growing sequences at once
    llm = run_and_compare(tiny_model, prompts, max_tokens=24, num_blocks=24)
    assert llm.engine.scheduler.num_preemptions > 0, "the cache was big enough: no preemption"
    assert llm.engine.kv_cache.num_used_blocks == 0


def test_parity_with_prefix_cache_hits(tiny_model):
    llm = LLM(tiny_model)
    prefix = "Paged attention stores keys and values in fixed-size blocks. " * 4
    prompts = mixed_prompts(llm.tokenizer, seed=2, shared_prefix=prefix)
    # two at a time, so later requests find the blocks the first ones computed
    llm = run_and_compare(tiny_model, prompts, max_num_seqs=2)
    stats = llm.engine.kv_cache.stats
    assert stats.hit_tokens >= 6 * 32, f"too few prefix-cache hits: {stats}"


def test_parity_with_chunked_prefill(tiny_model, monkeypatch):
    llm = LLM(tiny_model, max_num_batched_tokens=16)
    chunks = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        chunks.extend(s for s in out.scheduled if not s.samples)
        return out

    monkeypatch.setattr(llm.engine.scheduler, "schedule", recording_schedule)
    prompts = mixed_prompts(llm.tokenizer, seed=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert chunks, "no prompt was split into chunks"
    refs = hf_greedy(tiny_model, prompts, 12, set(llm.engine.eos_token_ids))
    assert_parity([o.token_ids for o in outs], refs)


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_parity(smollm2_path):
    llm = LLM(smollm2_path, dtype="float32")  # its config says bf16: auto would differ by CPU
    tok = llm.tokenizer
    texts = ["What is the capital of France?", "Write a haiku about the sea.",
             "List three primary colors.", "Explain paged attention in one sentence.",
             "1, 2, 3, 4,", "def fibonacci(n):", "Translate 'good morning' to French.",
             "The history of the printing press began"]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}],
                                                  tokenize=False, add_generation_prompt=True))
               if i % 2 == 0 else tok.encode(t) for i, t in enumerate(texts)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    refs = hf_greedy(smollm2_path, prompts, 24, set(llm.engine.eos_token_ids))
    assert_parity([o.token_ids for o in outs], refs)


def test_parity_with_a_large_mixed_length_batch(tiny_model):
    """24 prompts of very different lengths (the CPU decode op walks each sequence's own
    blocks; the torch fallback attends in length buckets)."""
    llm = LLM(tiny_model)
    prompts = mixed_prompts(llm.tokenizer, count=24, seed=7)
    assert max(map(len, prompts)) > 4 * min(map(len, prompts))
    run_and_compare(tiny_model, prompts, max_tokens=10)


def test_bucketed_decode_attention_matches_reference():
    import torch

    from tritonserve.engine.attention import bucketed_decode_attention
    from tritonserve.kernels import reference
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(400, 16, 2, 64, generator=gen)
    v_cache = torch.randn(400, 16, 2, 64, generator=gen)
    seq_lens = torch.randint(1, 150, (40,), generator=gen, dtype=torch.int32)
    tables = torch.randperm(400, generator=gen).view(40, 10).int()
    q = torch.randn(40, 8, 64, generator=gen)
    torch.testing.assert_close(
        bucketed_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125),
        reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_bf16_parity_with_transformers_in_bf16(tiny_models, arch):
    """bf16 against transformers in bf16 (the dtype a user on a bf16 CPU gets from --dtype
    auto), with the bf16 tie rule (tests/parity.py)."""
    import torch
    folder = tiny_models[arch]
    llm = LLM(folder, dtype="bfloat16")
    prompts = mixed_prompts(llm.tokenizer, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    refs = hf_greedy(folder, prompts, 16, set(llm.engine.eos_token_ids), torch.bfloat16)
    ties = assert_parity([o.token_ids for o in outs], refs, TIE_GAP_BF16)
    assert len(ties) <= len(prompts) // 2, ties  # most sequences agree to the last token
