"""gpt-oss (engine/models/families/gpt_oss.py): a tiny random checkpoint made by transformers
(tests/tiny_models.py: sliding and full layers alternating, attention sinks, YaRN, a biased
router and experts, a SwiGLU limit the random weights reach) gives transformers' greedy tokens
in fp32 for 32 tokens and its logprobs within tolerance, on the C++ ops (the attention's sinks
in kernels/cpu/paged_decode.cpp, the experts' biases and clamped SwiGLU in moe.cpp) and on
plain torch; the router against transformers (the attention kernels' sinks:
tests/test_kernels_window.py; the experts op's extras: tests/test_moe.py)."""
from __future__ import annotations

import pytest
import torch

from tritonserve.engine import LLM, SamplingParams
from tritonserve.engine.models import moe
from tritonserve.kernels import cpu
from tests.test_families_parity import assert_greedy_parity, hf_logprobs, prompts_for
from tests.tiny_models import write_tiny_model

needs_library = pytest.mark.skipif(not cpu.load(), reason="no CPU library here")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("gpt_oss"), "GptOssForCausalLM"))


def test_greedy_tokens_and_logprobs_equal_transformers(gpt_oss):
    llm = assert_greedy_parity(gpt_oss)
    variant = llm.engine.arch.variant
    assert variant.sinks and variant.o_bias and variant.experts.swiglu_limit == 1.0
    assert variant.windows == (8, None, 8, None)
    plan = llm.engine.runner.plan
    assert plan.experts == ("cpu" if cpu.load() else "torch")


def test_the_plain_torch_path_equals_transformers(gpt_oss, monkeypatch):
    """Without the C++ library: reference.paged_attention_masked takes the sinks and
    moe.grouped_experts the biases and the clamped SwiGLU."""
    monkeypatch.setattr(cpu, "load", lambda: False)
    monkeypatch.setattr(cpu, "LOADED", False)
    llm = assert_greedy_parity(gpt_oss)
    assert llm.engine.runner.plan.attention == "torch"


def test_sinks_and_the_swiglu_limit_change_the_tokens(gpt_oss, tmp_path):
    """The parity above can fail: with the sinks zeroed or the limit lifted, the same
    checkpoint decodes other tokens than transformers does on the true one."""
    import json
    import shutil
    from safetensors.torch import load_file, save_file

    llm = LLM(gpt_oss, dtype="float32", decode_mode="eager")
    prompt = prompts_for(llm.tokenizer)[-1]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    true = llm.generate([prompt], params)[0]
    for change in ("sinks", "limit"):
        folder = tmp_path / change
        shutil.copytree(gpt_oss, folder)
        if change == "sinks":
            state = load_file(folder / "model.safetensors")
            save_file({k: torch.zeros_like(v) if k.endswith(".sinks") else v
                       for k, v in state.items()}, folder / "model.safetensors",
                      metadata={"format": "pt"})
        else:
            config = json.loads((folder / "config.json").read_text())
            config["swiglu_limit"] = 100.0
            (folder / "config.json").write_text(json.dumps(config))
        out = LLM(str(folder), dtype="float32", decode_mode="eager").generate([prompt],
                                                                             params)[0]
        gap = max(abs(a.logprob - b.logprob) for a, b in zip(out.logprobs, true.logprobs))
        assert out.token_ids != true.token_ids or gap > 0.05, change


def test_the_router_takes_top_k_of_the_logits_then_their_softmax():
    """gpt-oss's router as transformers' GptOssTopKRouter: ids and weights alike."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    config = GptOssConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=3)
    theirs = GptOssTopKRouter(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(8, 16, generator=g))
        theirs.bias.copy_(torch.randn(8, generator=g))
    ours = moe.Router(16, 8, bias=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 16, generator=g)
    _, want_w, want_ids = theirs(x)
    ids, weights = moe.route(ours(x), 3, False, softmax_last=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w)


@needs_library
def test_bfloat16_and_the_compiled_step_stay_near_transformers(gpt_oss):
    """The path a user on this CPU gets: auto (the layers op refuses the sinks and biases,
    so the compiled graph, which calls the C++ decode and experts ops), in bf16: each greedy
    token's logprob within bf16's rounding of transformers' fp32; in fp32 the compiled step's
    tokens are eager's."""
    llm = LLM(gpt_oss, dtype="bfloat16")
    plan = llm.engine.runner.plan
    assert "attention sinks" in plan.why_mode and plan.experts == "cpu"
    prompt = prompts_for(llm.tokenizer)[-1]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, logprobs=0))[0]
    theirs = hf_logprobs(gpt_oss, prompt, out.token_ids)
    errors = sorted(abs(t.logprob - b) for t, b in zip(out.logprobs, theirs))
    assert errors[len(errors) // 2] < 0.1 and errors[-1] < 0.5
    tokens = {}
    for mode in ("eager", "auto"):
        run = LLM(gpt_oss, dtype="float32", decode_mode=mode)
        outs = run.generate(prompts_for(run.tokenizer),
                            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        tokens[mode] = [o.token_ids for o in outs]
    assert tokens["auto"] == tokens["eager"]


@pytest.mark.slow
def test_two_tensor_parallel_ranks_give_one_ranks_tokens(gpt_oss):
    """tp 2: each rank holds half of the heads (their sinks too) and of every expert's rows;
    the o and expert down biases, added before the all-reduce, are rank 0's alone (the other
    rank holds zeros: moe.SUMMED), so the sum adds them once. Greedy tokens and logprobs as
    one rank's."""
    from tests.test_moe import assert_two_ranks_give_one_ranks_tokens

    assert_two_ranks_give_one_ranks_tokens(gpt_oss)


def test_mxfp4_blocks_parse_into_s8_exactly():
    """An MXFP4 tensor's blocks as s8 (doubled e2m1 codes under a power-of-two scale) give
    gguf-py's own dequantization bit for bit."""
    import gguf
    import numpy as np
    from tritonserve.engine.models.gguf import parse_blocks

    w = np.random.default_rng(0).standard_normal((48, 128)).astype(np.float32)
    w[3] *= 1e-3  # small exponents too
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)
    d, q, m = parse_blocks("MXFP4", blocks, 48, 128)
    assert m is None and int(q.abs().max()) <= 12
    got = (d.repeat_interleave(32, dim=1) * q.float()).numpy()
    assert np.array_equal(got, want)
    assert np.array_equal(d.half().float().numpy(), d.numpy())  # the fp16 record holds it


@pytest.mark.slow
@needs_library
def test_the_family_as_a_gguf_file(tmp_path, monkeypatch):
    """As llama.cpp writes it (`gpt-oss`, experts split and stacked with their biases, sinks
    as attn_sinks, the SwiGLU limit its graph's 7): F32, the converted folder's tokens are
    transformers'; with the experts in MXFP4 (the rest Q8_0) the experts are served as s8
    blocks and give the tokens of the same file loaded dense; the memory check counts them
    at s8's bytes."""
    from tests.test_moe import assert_the_gguf_file_round_trips

    f32, blocks = assert_the_gguf_file_round_trips(tmp_path, "GptOssForCausalLM",
                                                   swiglu_limit=7.0)
    assert f32.engine.arch.variant.windows == (8, None, 8, None)
    # memory: the MXFP4 experts count at s8's bytes, twice theirs in the file
    from tritonserve.engine import memory
    from tritonserve.engine.models.gguf import served_bytes
    size = blocks.stat().st_size
    assert served_bytes(blocks) > size * 1.2
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: size + 4096)  # the file
    with pytest.raises(ValueError, match="the weights take .* GiB of memory are available"):
        LLM(str(blocks), dtype="float32", quantization="gguf")  # fits, its blocks do not


@pytest.mark.slow
def test_the_triton_path_gives_the_torch_paths_tokens(gpt_oss):
    """attention_backend triton (interpreted here): the decode and prefill kernels take the
    sinks and the windows (TritonAttention.masked); greedy tokens equal the torch path's."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = ["Hello world", "The quick brown fox jumps over the lazy dog."]
    want = LLM(gpt_oss, dtype="float32", attention_backend="torch").generate(prompts, params)
    llm = LLM(gpt_oss, dtype="float32", attention_backend="triton")
    assert llm.engine.runner.backend.name == "triton"
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
