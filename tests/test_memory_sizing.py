"""The KV cache and max_model_len agree at start-up (one max_model_len sequence always fits,
or start-up refuses in one line), requests are admitted by what they need now, a device
out-of-memory while allocating the cache is one line too; a sliding-window model's window is
read per family (served past it: tests/test_families_parity.py)."""
from __future__ import annotations

import pytest
import torch

from tritonserve.engine import LLM, InvalidRequestError, LLMEngine, SamplingParams
from tritonserve.engine.config import CacheConfig, EngineConfig
from tritonserve.engine.llm import build_config
from tritonserve.engine.models import ModelArch
from tests.tiny_models import write_tiny_model


def test_max_model_len_is_capped_by_the_cache(tiny_model):
    assert LLM(tiny_model, num_blocks=6).engine.max_model_len == 96
    assert LLM(tiny_model).engine.max_model_len == 512  # the model's positions fit


def test_a_max_model_len_the_cache_cannot_hold_is_refused(tiny_model):
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        LLM(tiny_model, num_blocks=4, max_model_len=100)


def test_long_context_model_with_a_small_cache_serves_default_chat_lengths(tmp_path):
    """The issue's case: 131,072 positions, 64 blocks. A chat request without max_tokens asks
    for the rest of the context; it is admitted and runs."""
    folder = write_tiny_model(tmp_path / "long", max_position_embeddings=131072)
    engine = LLMEngine(build_config(str(folder), num_blocks=64))
    assert engine.max_model_len == 64 * 16
    prompt = engine.tokenize("hello there")
    rid = engine.add_request(prompt, SamplingParams(max_tokens=engine.max_model_len
                                                    - len(prompt), ignore_eos=True))
    tokens = 0
    for _ in range(4):
        tokens += sum(s.token is not None for s in engine.step())
    assert tokens == 4
    engine.abort(rid)
    engine.step()
    assert engine.kv_cache.num_used_blocks == 0


def test_requests_are_admitted_by_what_they_need_now(tiny_model):
    """Four requests whose worst cases add up to twice the cache all run to the end (the
    cache fills, the scheduler preempts, every token comes)."""
    llm = LLM(tiny_model, num_blocks=12)
    outs = llm.generate(["a b c", "d e f", "g h i", "j k l"],
                        SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [90] * 4
    assert llm.engine.scheduler.num_preemptions > 0
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate(["x"], SamplingParams(max_tokens=llm.engine.max_model_len))


def test_out_of_memory_while_allocating_the_cache_is_one_line(tiny_model, monkeypatch):
    import tritonserve.engine.model_runner as runner

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
    monkeypatch.setattr(runner.torch, "zeros", no_memory)
    with pytest.raises(ValueError, match="does not fit in cpu memory") as exc:
        LLM(tiny_model)
    assert "\n" not in str(exc.value)


def test_sliding_window_is_read_per_family():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    mistral = ModelArch.from_dict({**base, "architectures": ["MistralForCausalLM"],
                                   "sliding_window": 64})
    assert mistral.sliding_window == 64
    assert ModelArch.from_dict({**base, "architectures": ["MistralForCausalLM"],
                                "sliding_window": None}).sliding_window is None
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "sliding_window": 32}
    assert ModelArch.from_dict({**qwen, "use_sliding_window": False}).sliding_window is None
    assert ModelArch.from_dict({**qwen, "use_sliding_window": True}).sliding_window == 32
    assert ModelArch.from_dict({**base, "architectures": ["LlamaForCausalLM"]}
                               ).sliding_window is None


def test_cpu_cache_is_sized_from_available_memory(tiny_model, monkeypatch):
    import tritonserve.engine.memory as memory

    arch = LLM(tiny_model, num_blocks=1).engine.arch
    weights = memory.weight_bytes(EngineConfig(dtype="float32"), arch)
    per_token = arch.kv_bytes_per_token(torch.float32)
    per_block = per_token * 16
    # half of what is left after the weights
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: weights + (64 << 20))
    assert LLM(tiny_model, max_num_seqs=4096).engine.kv_cache.num_blocks == \
        (32 << 20) // per_block
    # no more than twice max_num_seqs sequences of max_model_len
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: weights + (64 << 30))
    assert LLM(tiny_model, max_num_seqs=8).engine.kv_cache.num_blocks == \
        2 * 8 * 512 * per_token // per_block
    # and never more than CPU_MAX_AUTO_BYTES
    monkeypatch.setattr(memory, "CPU_MAX_AUTO_BYTES", 4 << 20)
    assert LLM(tiny_model).engine.kv_cache.num_blocks == (4 << 20) // per_block
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: weights)
    with pytest.raises(ValueError, match="no memory is left for the KV cache"):
        LLM(tiny_model)
    assert LLM(tiny_model, cache_bytes=per_block * 9).engine.kv_cache.num_blocks == 9
    # weights larger than the memory: refused before anything loads, the sizes named
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: weights // 2)
    with pytest.raises(ValueError, match="the weights take .* GiB of memory are available"):
        LLM(tiny_model, cache_bytes=per_block * 9)


def test_cuda_budget_follows_vllms_rule():
    from tritonserve.engine.memory import cuda_cache_bytes
    gib = 1 << 30
    # an H200 after loading: 141 GiB, 17 GiB in use (16 GiB of bf16 8B weights, 1 GiB of
    # context and others), a profiled step peaking at 2 GiB
    assert cuda_cache_bytes(141 * gib, 124 * gib, 2 * gib, 0.9) == \
        int(0.9 * 141 * gib) - 19 * gib
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(None, gpu_memory_utilization=1.5)


def test_profiled_step_runs_the_largest_batch_and_leaves_the_engine_intact(tiny_model):
    """The profile pass (CUDA sizes its cache from its peak) runs the largest step's shape:
    max_num_batched_tokens prompt tokens cut into max_model_len sequences, then the logits of
    max_num_seqs rows; it writes nothing into the engine's cache. On the CPU it measures 0."""
    from tritonserve.engine.memory import profiles_cache

    params = SamplingParams(temperature=0.0, max_tokens=6)
    llm = LLM(tiny_model, max_model_len=40, max_num_batched_tokens=100, num_blocks=32)
    before = llm.generate([[5, 6, 7, 8]], params)[0].token_ids
    cache_before = [k.clone() for k, _ in llm.engine.runner.kv_caches]
    assert llm.engine.runner.profile_peak_bytes(40) == 0
    assert all(torch.equal(k, c) for (k, _), c in zip(llm.engine.runner.kv_caches, cache_before))
    assert llm.generate([[5, 6, 7, 8]], params)[0].token_ids == before
    assert not profiles_cache(EngineConfig())
    assert not profiles_cache(EngineConfig(device="cuda", cache=CacheConfig(num_blocks=8)))
    assert profiles_cache(EngineConfig(device="cuda"))
