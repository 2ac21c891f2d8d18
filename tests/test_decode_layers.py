"""decode_mode layers: a decode step's whole decoder stack as one C++ op
(kernels/cpu/decode_layers.cpp), the CPU default in bf16 and fp32. In bf16 it must give the
eager step's hidden states bit for bit (same kernels, same roundings, one parallel region)
and write the caches as the eager step does; in fp32 (its rope in one C++ pass where eager
fp32 runs torch's ops) stay within fp32 rounding of it and token-identical to transformers;
refuse bad metadata before writing anything; and give way to the compiled step where it does
not take the model."""
from __future__ import annotations

import pytest
import torch

from tritonserve.engine import LLM, SamplingParams
from tritonserve.engine.config import EngineConfig
from tritonserve.kernels import cpu
from tests.parity import TIE_GAP_BF16, assert_parity, hf_greedy
from tests.test_engine_parity import mixed_prompts
from tests.tiny_models import write_tiny_model

# the op's attention has instances for head sizes 64 and 128 (the tiny test model's is 16)
needs_op = pytest.mark.skipif(cpu.decode_layers(torch.bfloat16, 64, 2, 16) is None,
                              reason="no AVX512-BF16 build of the C++ ops")
needs_fp32_op = pytest.mark.skipif(cpu.decode_layers(torch.float32, 16, 2, 16) is None,
                                   reason="no C++ toolchain")
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2,
             num_key_value_heads=1)


@pytest.fixture(scope="module")
def op_models(tmp_path_factory) -> dict[str, str]:
    """Llama (untied) and Qwen2 (qkv bias, tied embeddings) in shapes the op takes. Seed 1:
    seed 0's Llama puts one prompt's reference top two logits exactly 0.125 apart (the bf16
    tie rule's edge), where the eager bf16 step diverges from transformers as the op does."""
    return {
        "llama": str(write_tiny_model(tmp_path_factory.mktemp("layers-llama"), seed=1,
                                      **SHAPE)),
        "qwen2": str(write_tiny_model(tmp_path_factory.mktemp("layers-qwen2"),
                                      "Qwen2ForCausalLM", seed=3, tie_word_embeddings=True,
                                      **SHAPE)),
    }


def _compare_with_eager(llm) -> list[tuple[int, float, bool]]:
    """Runs every decode-only step of `llm` (an eager engine) through the eager forward and
    then the op on the same inputs; returns per step (rows, the largest difference between
    the two hidden states relative to the largest value, whether hidden states and caches are
    bit-identical)."""
    runner = llm.engine.runner
    layers = runner.model.decode_layers(runner.block_size)
    assert layers is not None
    forward, steps = runner._forward, []

    def both(model_input, ctx):
        n = model_input.input_ids.shape[0]
        if model_input.meta.num_decode_tokens != n:
            return forward(model_input, ctx)
        eager = runner.model(model_input.input_ids, model_input.positions, ctx)
        caches = [(k.clone(), v.clone()) for k, v in ctx.kv_caches]
        fused = layers(model_input.input_ids, model_input.positions, ctx)
        same_caches = all(torch.equal(k, k2) and torch.equal(v, v2)
                          for (k, v), (k2, v2) in zip(ctx.kv_caches, caches))
        gap = ((eager.float() - fused.float()).abs().max() / eager.float().abs().max()).item()
        steps.append((n, gap, torch.equal(eager, fused) and same_caches))
        return fused

    runner._forward = both
    return steps


def nine_shrinking_to_one(llm) -> list[tuple[int, float, bool]]:
    """_compare_with_eager over 9 sequences ending one by one (batches of 9 down to 1)."""
    steps = _compare_with_eager(llm)
    prompts = mixed_prompts(llm.tokenizer, count=9, seed=7)
    lengths = [4, 9, 14, 20, 26, 30, 34, 38, 40]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n,
                                                 ignore_eos=True) for n in lengths])
    assert [len(o.token_ids) for o in outs] == lengths
    assert {9, 1} <= {n for n, _, _ in steps}
    return steps


def two_long_then_one(llm, longer: int) -> list[tuple[int, float, bool]]:
    """_compare_with_eager over two sequences of 300 and 430 prompt tokens (past 256: split
    into parts at batch <= 2), the first ending after 6 tokens, the other after `longer`."""
    steps = _compare_with_eager(llm)
    vocab = llm.engine.arch.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(300)], [(5 * i + 1) % vocab for i in range(430)]]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                  for n in (6, longer)])
    assert [len(o.token_ids) for o in outs] == [6, longer]
    assert {2, 1} <= {n for n, _, _ in steps}
    return steps


@needs_op
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_the_op_gives_the_eager_step_bit_for_bit(op_models, name):
    """Batches of 9 sequences (whole-sequence attention items at 9 >= 4 x 2 threads) shrinking
    to 1 (one item a KV head), contexts of 1 to 5 pages: the op's hidden states and the K/V it
    writes are the eager step's, bit for bit, at every size."""
    llm = LLM(op_models[name], dtype="bfloat16", decode_mode="eager", max_num_seqs=16)
    steps = nine_shrinking_to_one(llm)
    assert all(same for _, _, same in steps), [n for n, _, same in steps if not same]


@needs_op
def test_the_op_gives_the_eager_step_bit_for_bit_when_sequences_split(op_models):
    """Two sequences past 256 tokens, then one: at batch <= 2 the bf16 attention splits each
    sequence's pages into parts of 256 tokens merged afterwards (page_sweep.h's Items), and
    the op runs every rope and K/V write before the parts: hidden states and caches still the
    eager step's (which splits the same way), bit for bit."""
    llm = LLM(op_models["llama"], dtype="bfloat16", decode_mode="eager", max_num_seqs=4)
    steps = two_long_then_one(llm, 60)
    assert all(same for _, _, same in steps), [n for n, _, same in steps if not same]


@needs_fp32_op
def test_the_fp32_op_stays_within_rounding_of_the_eager_step(tiny_models):
    """fp32 (the tiny models' head size 16, group 2: the portable attention): the op's hidden
    states within 1e-5 of the eager step's, relative to their largest value, at batches of 9
    down to 1 (the rope rounds once in C++ where eager fp32 runs torch's ops), for Llama and
    Qwen2 with its qkv bias."""
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM"):
        llm = LLM(tiny_models[arch], dtype="float32", decode_mode="eager", max_num_seqs=16)
        steps = nine_shrinking_to_one(llm)
        assert max(gap for _, gap, _ in steps) < 1e-5, arch


@needs_fp32_op
def test_the_fp32_op_stays_within_rounding_of_the_eager_step_when_sequences_split(tiny_models):
    """fp32, two sequences past 256 tokens (the tiny models hold 512), then one: the portable attention splits their
    pages into parts of 256 tokens merged after (page_sweep.h's Items) in the op and in the
    eager step's paged_decode_attention alike: hidden states within 1e-5 of eager's."""
    llm = LLM(tiny_models["LlamaForCausalLM"], dtype="float32", decode_mode="eager",
              max_num_seqs=4)
    steps = two_long_then_one(llm, 40)
    assert max(gap for _, gap, _ in steps) < 1e-5


@needs_op
def test_layers_is_the_cpu_default_and_matches_transformers_in_bf16(op_models):
    """`auto` on the CPU (fp32 and bf16): no graph to build, every decode step through the
    op, and bf16 greedy output against transformers in bf16 under the bf16 tie rule
    (tests/parity.py)."""
    llm = LLM(op_models["llama"], dtype="bfloat16", max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.decode_mode == "layers" and runner.graphs is None
    calls = []
    layers = runner.decode_step
    runner.decode_step = lambda ids, *rest: calls.append(ids.shape[0]) or layers(ids, *rest)
    prompts = mixed_prompts(llm.tokenizer, count=7, seed=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert calls and max(calls) == 4
    refs = hf_greedy(op_models["llama"], prompts, 12, set(llm.engine.eos_token_ids),
                     torch.bfloat16)
    ties = assert_parity([o.token_ids for o in outs], refs, TIE_GAP_BF16)
    assert len(ties) <= len(prompts) // 2, ties


def test_layers_gives_way_where_it_does_not_take_the_model(tiny_model, tiny_models, caplog):
    """The tiny model's head size (16) has no bf16 attention instance: `auto` runs the
    compiled step instead and says why; asked for by name, layers refuses, naming
    decode_mode (so does a model with q/k norms, in any dtype); it is a CPU mode."""
    with caplog.at_level("INFO", logger="tritonserve.engine"):
        llm = LLM(tiny_model, dtype="bfloat16", max_num_seqs=2)
    assert llm.engine.runner.decode_mode == "compile"
    assert "decode compile (auto; layers does not take LlamaForCausalLM in bfloat16: no " \
        "instance for head size 16" in caplog.text
    with pytest.raises(ValueError, match="decode_mode 'layers'"):
        LLM(tiny_model, dtype="bfloat16", decode_mode="layers")
    with pytest.raises(ValueError, match="decode_mode 'layers'"):
        LLM(tiny_models["Qwen3ForCausalLM"], dtype="float32", decode_mode="layers")  # q/k norms
    with pytest.raises(ValueError, match="decode_mode 'layers'"):
        EngineConfig(decode_mode="layers", attention_backend="triton")


@needs_fp32_op
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"])
def test_fp32_layers_is_token_identical_to_transformers(tiny_models, arch):
    """fp32 greedy through the op, batches of up to 4 with sequences ending at different
    steps: token-identical to transformers (the fp32 tie rule), as the eager and compiled
    fp32 paths are."""
    llm = LLM(tiny_models[arch], dtype="float32", decode_mode="layers", max_num_seqs=4)
    assert llm.engine.runner.decode_mode == "layers"
    prompts = mixed_prompts(llm.tokenizer, count=7, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=14))
    assert_parity([o.token_ids for o in outs],
                  hf_greedy(tiny_models[arch], prompts, 14, set(llm.engine.eos_token_ids)))


@needs_op
def test_the_op_refuses_bad_metadata_before_writing(op_models):
    """A slot past the cache, a context length past the block table, or lists of the wrong
    length raise a RuntimeError naming what is wrong, and no cache has been written."""
    llm = LLM(op_models["llama"], dtype="bfloat16", decode_mode="eager", max_num_seqs=2,
              num_blocks=8)
    runner = llm.engine.runner
    model, caches = runner.model, runner.kv_caches
    op = cpu.decode_layers(torch.bfloat16, 64, 2, 16)
    args = _op_args(model, caches, torch.tensor([3, 36]), torch.tensor([4, 5], dtype=torch.int32))
    before = [(k.clone(), v.clone()) for k, v in caches]
    slots = caches[0][0].shape[0] * caches[0][0].shape[1]
    bad_slot = dict(args, slot_mapping=torch.tensor([3, slots]))  # the cache's slots: 0..slots-1
    with pytest.raises(RuntimeError, match=f"slot {slots} out of range"):
        op(**bad_slot)
    bad_len = dict(args, seq_lens=torch.tensor([4, 33], dtype=torch.int32))  # 2 pages of 16
    with pytest.raises(RuntimeError, match="seq_len 33 out of range"):
        op(**bad_len)
    with pytest.raises(RuntimeError, match="4L panels"):
        op(**dict(args, panels=args["panels"][:-1]))
    assert all(torch.equal(k, k0) and torch.equal(v, v0)
               for (k, v), (k0, v0) in zip(caches, before))
    x, residual = op(**args)  # the same arguments, valid: it runs
    assert x.shape == residual.shape == (2, 128)
    assert not torch.equal(caches[0][0].view(-1, 64)[36], before[0][0].view(-1, 64)[36])


@needs_op
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_op_looks_up_and_norms_as_the_model_does(op_models, dtype):
    """With input_ids, positions and final_norm the op takes the embedding and rope tables
    whole and ends with the final norm: bit for bit the op fed the model's own lookups, then
    the model's final add + norm; the same cache writes. A token id or position past its
    table raises naming it, before anything is written."""
    llm = LLM(op_models["llama"], dtype=dtype, decode_mode="eager", max_num_seqs=2,
              num_blocks=8)
    runner = llm.engine.runner
    model = runner.model
    op = cpu.decode_layers(getattr(torch, dtype), 64, 2, 16)
    args = _op_args(model, runner.kv_caches, torch.tensor([3, 36]),
                    torch.tensor([4, 5], dtype=torch.int32))
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]

    def run(**over):
        caches = [(k.clone(), v.clone()) for k, v in before]
        out = op(**dict(args, k_caches=[k for k, _ in caches],
                        v_caches=[v for _, v in caches], **over))
        return out, caches

    (x, residual), caches = run()
    want = model.norm(x.clone(), residual.clone())
    table = model.embed_tokens.weight
    cos, sin = (t.to(table.dtype).unsqueeze(1) for t in (model.rope.cos, model.rope.sin))
    ids, positions = torch.tensor([5, 6]), torch.tensor([3, 4])
    whole = dict(x=table, cos=cos, sin=sin, input_ids=ids, positions=positions,
                 final_norm=model.norm.weight)
    (got, got_residual), got_caches = run(**whole)
    assert torch.equal(got, want[0]) and torch.equal(got_residual, want[1])
    assert all(torch.equal(a, b) for pair, pair0 in zip(caches, got_caches)
               for a, b in zip(pair, pair0))
    vocab, positions_n = table.shape[0], cos.shape[0]
    with pytest.raises(RuntimeError, match=f"input_ids: token id {vocab} out of range"):
        run(**dict(whole, input_ids=torch.tensor([5, vocab])))
    with pytest.raises(RuntimeError, match=f"positions: position {positions_n} out of range"):
        run(**dict(whole, positions=torch.tensor([positions_n, 4])))
    torch.library.opcheck(torch.ops.tritonserve.decode_layers.default, (), dict(args, **whole),
                          test_utils=("test_schema", "test_faketensor"))


def _op_args(model, caches, slot_mapping, seq_lens) -> dict:
    """The op's arguments for two decode rows of `model` (block tables of 2 pages of 16; the
    rows' slots and lengths as given)."""
    x = model.embed_tokens(torch.tensor([5, 6]))
    cos, sin = model.rope.lookup(torch.tensor([3, 4]), x.dtype)
    layers = model.layers
    return dict(
        x=x, norms=[n.weight for layer in layers
                    for n in (layer.input_layernorm, layer.post_attention_layernorm)],
        panels=[m.weight for layer in layers for m in (
            layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj)],
        biases=[], cos=cos, sin=sin, slot_mapping=slot_mapping,
        k_caches=[k for k, _ in caches], v_caches=[v for _, v in caches],
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), seq_lens=seq_lens,
        num_heads=2, eps=model.arch.rms_norm_eps, scale=64 ** -0.5)


@needs_op
def test_the_ops_fake_agrees_with_it(op_models):
    """What torch.compile would trace: the fake's shapes and dtypes are the op's, and the
    schema declares the caches it writes."""
    llm = LLM(op_models["llama"], dtype="bfloat16", decode_mode="eager", max_num_seqs=2,
              num_blocks=8)
    runner = llm.engine.runner
    args = _op_args(runner.model, runner.kv_caches, torch.tensor([3, 36]),
                    torch.tensor([4, 5], dtype=torch.int32))
    torch.library.opcheck(torch.ops.tritonserve.decode_layers.default, (), args,
                          test_utils=("test_schema", "test_faketensor"))


@needs_op
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_op_does_not_depend_on_the_thread_count(op_models, dtype):
    """1, 2 or 3 threads (a team that does not divide the panels evenly, whose spans are taken
    from each other's backs): the same hidden states and cache writes, bit for bit."""
    llm = LLM(op_models["qwen2"], dtype=dtype, decode_mode="eager", max_num_seqs=2,
              num_blocks=8)
    runner = llm.engine.runner
    args = _op_args(runner.model, runner.kv_caches, torch.tensor([3, 36]),
                    torch.tensor([4, 5], dtype=torch.int32))
    args["biases"] = [layer.self_attn.qkv_proj.bias for layer in runner.model.layers]
    op = cpu.decode_layers(getattr(torch, dtype), 64, 2, 16)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
            run = dict(args, k_caches=[k for k, _ in caches], v_caches=[v for _, v in caches])
            results.append((op(**run), caches))
    finally:
        torch.set_num_threads(threads)
    (x0, r0), caches0 = results[0]
    for (x, r), caches in results[1:]:
        assert torch.equal(x, x0) and torch.equal(r, r0)
        assert all(torch.equal(a, b) for pair, pair0 in zip(caches, caches0)
                   for a, b in zip(pair, pair0))


@needs_op
def test_the_phase_timing_covers_each_call_and_stays_off_unless_asked(op_models):
    """decode_layers_timing(True): every later call adds each thread's time to the six phases
    (norm, qkv, attention, o, gate/up, down), as work and as barrier waits, never more than
    the calls' wall time; off, the totals stop moving (kernels/cpu/phase_clock.h)."""
    import time
    llm = LLM(op_models["llama"], dtype="bfloat16", max_num_seqs=4)
    assert llm.engine.runner.decode_mode == "layers"
    prompts = mixed_prompts(llm.tokenizer, count=3, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate(prompts, params)  # prefill, warm-up
    assert cpu.decode_layers_timing(True)
    try:
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - start
        totals, calls = cpu.decode_layers_phases()
    finally:
        cpu.decode_layers_timing(False)
    threads = torch.get_num_threads()
    assert calls >= 5  # at least the 5 decode steps after each prefill
    assert totals.shape == (threads, len(cpu.DECODE_PHASES), 2)
    assert (totals[0, :, 0] > 0).all()  # thread 0 worked in every phase
    assert (totals >= 0).all() and (totals.sum(dim=(1, 2)) <= wall).all()
    llm.generate(prompts, params)
    after, calls_after = cpu.decode_layers_phases()
    assert calls_after == calls and torch.equal(after, totals)
