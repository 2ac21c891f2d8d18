"""Mixtures of experts (Qwen3-MoE, Mixtral, OLMoE): each a tiny random checkpoint made by
transformers (tests/tiny_models.py's FAMILY_SHAPES: 4-8 experts, top 2-3, Qwen3-MoE with a
dense first layer) gives transformers' greedy tokens in fp32 for 32 tokens, logprobs within
tolerance, and the same as a GGUF file written as llama.cpp's converter writes it (stacked
ffn_*_exps, the router as ffn_gate_inp), as F32 and as Q8_0 blocks served as blocks. The
experts op against kernels/reference.fused_moe in every weight form; routing as transformers
routes (ties included), the same in a batch as alone; and a step reads only the chosen
experts' bytes."""
from __future__ import annotations

import pytest
import torch

from tritonserve.engine import LLM, SamplingParams
from tritonserve.engine.models import moe
from tritonserve.kernels import cpu, quant_layout, reference
from tests.parity import assert_parity, hf_greedy
from tests.test_families_parity import assert_greedy_parity, hf_logprobs, prompts_for
from tests.tiny_models import write_tiny_model

FAMILIES = ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM"]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, str]:
    return {arch: str(write_tiny_model(tmp_path_factory.mktemp(arch), arch))
            for arch in FAMILIES}


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_tokens_and_logprobs_equal_transformers(moe_models, arch):
    llm = assert_greedy_parity(moe_models[arch])
    assert llm.engine.arch.variant.experts is not None


@pytest.mark.parametrize("arch", FAMILIES)
def test_bfloat16_panels_stay_near_transformers_fp32(moe_models, arch):
    """bf16 with the experts in C++ panels. A router near a tie picks another expert once
    the hidden state is rounded to bf16 (transformers' own bf16 does so on other rows than
    ours), which moves that token's logprob by more than rounding does (0.253 measured at one
    step of 16 on the tiny OLMoE, 0.01-0.06 elsewhere): the typical step within bf16's
    rounding, every step within half a unit (a wrong expert sum is whole units off)."""
    folder = moe_models[arch]
    llm = LLM(folder, dtype="bfloat16", decode_mode="eager")
    prompt = prompts_for(llm.tokenizer)[-1]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, logprobs=0))[0]
    theirs = hf_logprobs(folder, prompt, out.token_ids)
    errors = sorted(abs(t.logprob - b) for t, b in zip(out.logprobs, theirs))
    assert errors[len(errors) // 2] < 0.1 and errors[-1] < 0.5


@pytest.mark.slow
def test_the_compiled_step_equals_eager(moe_models):
    """The plan auto picks for a MoE model (compile: the layers op does not take experts)
    calls the experts op inside the graph: its tokens are eager's."""
    folder = moe_models["Qwen3MoeForCausalLM"]
    tokens = {}
    for mode in ("eager", "auto"):
        llm = LLM(folder, dtype="float32", decode_mode=mode)
        if mode == "auto":
            plan = llm.engine.runner.plan
            assert plan.mode == "compile" and "mixture of experts" in plan.why_mode
            assert plan.experts == "cpu" and "experts cpu" in plan.describe()
        outs = llm.generate(prompts_for(llm.tokenizer),
                            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        tokens[mode] = [o.token_ids for o in outs]
    assert tokens["auto"] == tokens["eager"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_family_as_a_gguf_file(tmp_path, arch):
    assert_the_gguf_file_round_trips(tmp_path, arch, mlp_only_layers=[])


def assert_the_gguf_file_round_trips(tmp_path, arch: str, **overrides):
    """F32: the converted folder's tokens are transformers'; Q8_0 blocks (experts stacked,
    each expert's blocks packed alone; gpt-oss's MXFP4) served as blocks give the tokens of
    the same file loaded dense (--quantization none: the experts dequantized from the file,
    which the converted folder leaves out) and the rest dequantized as transformers reads it.
    Returns the F32 engine and the blocks file."""
    from tests.gguf_files import write_gguf
    from tritonserve.engine.default_model import gguf_folder

    folder = write_tiny_model(tmp_path / "hf", arch, **overrides)
    f32 = LLM(str(write_gguf(folder, tmp_path / "f32.gguf")), dtype="float32",
              decode_mode="eager")
    assert f32.engine.arch.architecture == arch
    prompts = prompts_for(f32.tokenizer)[:3]
    outs = f32.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    assert_parity([o.token_ids for o in outs],
                  hf_greedy(str(folder), prompts, 32, set(f32.engine.eos_token_ids)))
    blocks = write_gguf(folder, tmp_path / "q8.gguf", quantized=True)
    llm = LLM(str(blocks), dtype="float32", decode_mode="eager", quantization="gguf")
    assert llm.engine.runner.plan.weights == "gguf"
    layer = llm.engine.runner.model.layers[-1].mlp
    assert isinstance(layer, moe.SparseMoE) and quant_layout.kind_of(layer.gate_up[0]) == "s8"
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    assert not any("experts" in name and name.endswith("weight")
                   for name in _stored(gguf_folder(blocks)))
    dense = LLM(str(blocks), dtype="float32", decode_mode="eager", quantization="none")
    assert dense.engine.runner.plan.weights != "gguf"
    refs = dense.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    assert [o.token_ids for o in outs] == [o.token_ids for o in refs]
    return f32, blocks


def _stored(folder) -> list[str]:
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return list(f.keys())


def _experts(e=6, h=64, i=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1)


def _routing(t, e, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    return moe.route(torch.randn(t, e, generator=g), k, normalize=True)


@pytest.mark.parametrize("form", ["plain", "panels", "u4", "s8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_the_experts_op_equals_the_reference(form, dtype, tokens, gpt_oss):
    """gpt_oss: with gate/up and down biases, top-k-then-softmax routing and the clamped
    SwiGLU (moe.cpp's Activation); without those extras its answer differs."""
    if cpu.op("moe_experts") is None:
        pytest.skip("no C++ library")
    gate_up, down = _experts()
    if form in ("u4", "s8"):  # the reference on the dequantized weights
        q_gu = torch.stack([quant_layout.quantize(w, form) for w in gate_up])
        q_d = torch.stack([quant_layout.quantize(w, form) for w in down])
        gate_up = torch.stack([quant_layout.dequantize(w, 64) for w in q_gu])
        down = torch.stack([quant_layout.dequantize(w, 64) for w in q_d])
        stored = (q_gu, q_d)
    elif form == "panels":
        if cpu.panel_ops(dtype) is None:
            pytest.skip(f"no {dtype} panels here")
        pack = cpu.panel_ops(dtype)[0]
        stored = tuple(torch.stack([pack(w.to(dtype).contiguous()) for w in t])
                       for t in (gate_up, down))
    else:
        stored = (gate_up.to(dtype), down.to(dtype))
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    ids, weights = _routing(tokens, 6, 2)
    extras = ()
    if gpt_oss:
        g = torch.Generator().manual_seed(3)
        extras = (torch.randn(6, 64, generator=g), torch.randn(6, 64, generator=g), 0.3, 1.702)
        ids, weights = moe.route(torch.randn(tokens, 6, generator=g), 2, False,
                                 softmax_last=True)
    got = moe.moe_experts(x, ids, weights, *stored, 32, *extras)
    args = (x.float(), gate_up.to(dtype).float(), down.to(dtype).float(), ids, weights)
    want = reference.fused_moe(*args, *extras)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # the torch path over the same forms agrees too
    torch.testing.assert_close(moe.grouped_experts(x, ids, weights, *stored, 32,
                                                   *extras).float(), want, rtol=tol, atol=tol)
    if gpt_oss:
        assert (reference.fused_moe(*args) - want).abs().max() > 0.1


def test_routing_breaks_ties_as_transformers():
    """Experts whose router rows are equal tie exactly; torch.topk's order is transformers'
    (its TopKRouter is run on the same weights)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    weight = torch.randn(8, 16)
    weight[5] = weight[2]  # 2 and 5 tie on every token
    weight[7] = weight[2]
    x = torch.randn(12, 16)
    config = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                            norm_topk_prob=True)
    theirs = Qwen3MoeTopKRouter(config)
    theirs.weight.data.copy_(weight)
    _, their_weights, their_ids = theirs(x)
    ours = moe.Router(16, 8)
    ours.weight = torch.nn.Parameter(weight.clone())
    ours.prepack()
    ids, weights = moe.route(ours(x), 3, normalize=True)
    assert torch.equal(ids, their_ids)
    torch.testing.assert_close(weights, their_weights)


def test_a_token_picks_the_same_experts_in_a_batch_as_alone():
    ours = moe.Router(64, 16)
    ours.weight = torch.nn.Parameter(torch.randn(16, 64))
    ours.prepack()
    x = torch.randn(16, 64)
    batch_ids, batch_weights = moe.route(ours(x), 4, normalize=False)
    for t in range(16):
        ids, weights = moe.route(ours(x[t:t + 1]), 4, normalize=False)
        assert torch.equal(ids[0], batch_ids[t])
        assert torch.equal(weights[0], batch_weights[t])


def test_a_step_reads_only_the_chosen_experts(moe_models):
    """The expert bytes a decode step gives its matmuls (moe.cpp counts them) are the
    chosen experts' and no others: top_k experts a MoE layer at batch 1; at batch 4 the
    distinct experts the router chose, each once."""
    if cpu.op("moe_bytes_read") is None:
        pytest.skip("no C++ library")
    llm = LLM(moe_models["Qwen3MoeForCausalLM"], dtype="float32", decode_mode="eager")
    model = llm.engine.runner.model
    layers = [layer.mlp for layer in model.layers if isinstance(layer.mlp, moe.SparseMoE)]
    spec = layers[0].spec
    chosen: list[tuple[int, set[int]]] = []  # (rows, experts chosen) a MoE layer
    hooks = [m.register_forward_hook(
        lambda mod, args, out: chosen.append((args[0].shape[0], set(moe.route(
            mod.gate(args[0]), spec.top_k, spec.normalize)[0].flatten().tolist()))))
        for m in layers]
    prompts = prompts_for(llm.tokenizer)
    decode_steps = 0
    for batch in ([prompts[-1]], prompts[1:5]):
        for p in batch:
            llm.engine.add_request(list(p), SamplingParams(temperature=0.0, max_tokens=3,
                                                           ignore_eos=True))
        while llm.engine.has_unfinished_requests():
            chosen.clear()
            torch.ops.tritonserve.moe_bytes_read(True)
            llm.engine.step()
            read = torch.ops.tritonserve.moe_bytes_read(True)
            if not chosen or chosen[0][0] != len(batch):
                continue  # a prefill step
            decode_steps += 1
            assert read == sum(len(c) for _, c in chosen) * layers[0].expert_bytes()
            if len(batch) == 1:
                assert all(len(c) == spec.top_k for _, c in chosen)
            assert read < len(layers) * spec.count * layers[0].expert_bytes()
    for hook in hooks:
        hook.remove()
    assert decode_steps == 4


def test_experts_larger_than_memory_are_refused_with_the_sizes(moe_models, monkeypatch):
    from tritonserve.engine import memory
    folder = moe_models["MixtralForCausalLM"]
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 100_000)
    with pytest.raises(ValueError, match=r"weights take 0\.0 GiB \(0\.0 GiB of them experts\) "
                       r"and 0\.0 GiB of memory are available"):
        LLM(folder, dtype="float32")


def test_dummy_weights_take_moe_shapes(moe_models):
    """--load-format dummy: random weights from config.json alone, experts included (the
    benchmarks' large shapes without a download); the arch counts the experts' parameters
    and the active ones a token reads."""
    llm = LLM(moe_models["Qwen3MoeForCausalLM"], dtype="float32", load_format="dummy")
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4,
                                                   ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    arch = llm.engine.arch
    model = llm.engine.runner.model
    counted = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name)
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    assert arch.num_params == counted + norms - sum(  # q/k norms are not in the count
        p.numel() for name, p in model.named_parameters() if "q_norm" in name or "k_norm" in name)
    spec = arch.variant.experts
    moe_layers = sum(spec.sparse(i) for i in range(arch.num_layers))
    assert arch.expert_params == moe_layers * (spec.count - spec.top_k) * 3 * \
        arch.hidden_size * spec.intermediate


@pytest.mark.parametrize("arch", FAMILIES)
def test_speculation_and_prefix_caching_keep_greedy_tokens(moe_models, arch):
    """n-gram speculation's verify rows route as plain decoding's rows do, and a prompt whose
    prefix is cached gives the tokens of one computed whole."""
    from tests.test_families_serving import SPEC
    prompts = ["one two three four five one two three four five one two three",
               "the cat sat on the mat. the cat sat on the mat. the cat"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(moe_models[arch], dtype="float32", decode_mode="eager",
                enable_prefix_caching=False).generate(prompts, params)
    spec_llm = LLM(moe_models[arch], dtype="float32", decode_mode="eager", **SPEC)
    spec = spec_llm.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_llm.engine.spec_stats.proposed > 0
    cached = LLM(moe_models[arch], dtype="float32", decode_mode="eager")
    cached.generate(prompts[:1], params)  # its blocks stay in the prefix cache
    before = cached.engine.kv_cache.stats.hit_tokens
    again = cached.generate(prompts[:1], params)[0]
    assert cached.engine.kv_cache.stats.hit_tokens > before
    assert again.token_ids == plain[0].token_ids


@pytest.mark.slow
def test_openai_conformance_on_a_mixture_of_experts(moe_models, tmp_path):
    """The OpenAI conformance suite (streams, structured output, tools) against a server on
    the tiny Qwen3-MoE, on the plan auto picks."""
    from tests.test_families_serving import conformance_failures
    failed, _ = conformance_failures(moe_models["Qwen3MoeForCausalLM"], tmp_path)
    assert not failed, failed


@pytest.mark.slow
def test_two_tensor_parallel_ranks_split_every_expert(moe_models):
    """tp 2: each rank holds half of every expert's rows (gate/up by rows, down by columns),
    its partial sums all-reduced after the experts: one rank's greedy tokens and logprobs."""
    assert_two_ranks_give_one_ranks_tokens(moe_models["Qwen3MoeForCausalLM"])


def assert_two_ranks_give_one_ranks_tokens(folder: str) -> None:
    from tests.test_tensor_parallel import run
    prompts = [[5 + i for i in range(n)] for n in (3, 9, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    one, _ = run(folder, "float32", 1, prompts, params)
    two, plan = run(folder, "float32", 2, prompts, params)
    assert "tensor_parallel_size 2" in plan.why_mode
    for a, b in zip(one, two):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_a_gguf_files_experts_are_never_loaded_dense(tmp_path, monkeypatch):
    """Served as blocks, a file's experts are neither in the converted folder nor allocated
    dense at load (a 30B-A3B file's would take 120 GB in fp32); loaded dense (quantization
    none) they are dequantized from the file, and give the blocks' tokens on Q8_0."""
    from tests.gguf_files import write_gguf
    from tritonserve.engine.models import loader

    folder = write_tiny_model(tmp_path / "hf", "OlmoeForCausalLM")
    blocks = write_gguf(folder, tmp_path / "q8.gguf", quantized=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    built = []
    real = loader.build_model
    monkeypatch.setattr("tritonserve.engine.model_runner.build_model",
                        lambda *a, **k: built.append(k["experts_later"]) or real(*a, **k))
    llm = LLM(str(blocks), dtype="float32", decode_mode="eager")
    assert built == [True] and llm.engine.runner.plan.weights == "gguf"
    assert llm.engine.runner.model.layers[0].mlp.gate_up.dtype == torch.uint8
    later = [o.token_ids for o in llm.generate(prompts, params)]
    dense = LLM(str(blocks), dtype="float32", decode_mode="eager", quantization="none")
    assert built == [True, False]
    assert dense.engine.runner.model.layers[0].mlp.gate_up.dtype != torch.uint8
    assert [o.token_ids for o in dense.generate(prompts, params)] == later
