"""Decode steps on static buffers per batch bucket (engine/decode_graphs.py): the path CUDA
graphs replay, run here without the capture (static) and compiled (Inductor on the CPU).
Greedy output stays token-identical to transformers; padding rows touch only the null block."""
from __future__ import annotations

import pytest
import torch

from tritonserve.engine import LLM, SamplingParams
from tritonserve.engine.attention import AttentionMetadata, CpuAttention
from tritonserve.engine.config import EngineConfig
from tritonserve.engine.decode_graphs import DecodeGraphs, bucket_sizes
from tritonserve.engine.models import ForwardContext, ModelArch
from tritonserve.engine.models.loader import build_model
from tritonserve.kernels import cpu
from tests.parity import TIE_GAP_BF16, assert_parity, hf_greedy
from tests.test_engine_parity import mixed_prompts, run_and_compare
from tests.tiny_models import write_tiny_model


def test_bucket_sizes():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert bucket_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    assert bucket_sizes(64)[-3:] == [48, 56, 64]


def count_graph_runs(llm) -> list[int]:
    """Wraps the runner's DecodeGraphs.run; returns the list the batch sizes land in."""
    graphs = llm.engine.runner.graphs
    calls: list[int] = []
    original = graphs.run

    def run(input_ids, positions, meta):
        calls.append(input_ids.shape[0])
        return original(input_ids, positions, meta)

    graphs.run = run
    return calls


def test_static_decode_matches_transformers_across_buckets(tiny_model):
    """11 prompts of mixed lengths: decode batches of 11 (bucket 16, 5 padding rows) down to
    1 as sequences finish at different lengths, max_num_seqs 12 (a bucket that is no power
    of two), and preemption none: every decode step goes through the buckets."""
    probe = LLM(tiny_model, decode_mode="static", max_num_seqs=12)
    assert probe.engine.runner.graphs.sizes == [1, 2, 4, 8, 12]
    calls = count_graph_runs(probe)
    prompts = mixed_prompts(probe.tokenizer, count=11, seed=5)
    outs = probe.generate(prompts, SamplingParams(temperature=0.0, max_tokens=14))
    assert calls and max(calls) == 11 and min(calls) >= 1
    assert any(n not in probe.engine.runner.graphs.sizes for n in calls)  # padded steps ran
    assert_parity([o.token_ids for o in outs],
                  hf_greedy(tiny_model, prompts, 14, set(probe.engine.eos_token_ids)))
    assert probe.engine.kv_cache.num_used_blocks == 0


def test_static_decode_under_preemption_and_prefix_hits(tiny_model):
    llm = LLM(tiny_model)
    prefix = "Paged attention stores keys and values in fixed-size blocks. " * 3
    prompts = mixed_prompts(llm.tokenizer, seed=2, shared_prefix=prefix)
    llm = run_and_compare(tiny_model, prompts, max_tokens=20, num_blocks=30,
                          decode_mode="static", max_num_seqs=8)
    assert llm.engine.scheduler.num_preemptions > 0


def test_padding_rows_write_only_the_null_block(tiny_model):
    arch = ModelArch.from_folder(tiny_model)
    model = build_model(arch, tiny_model, torch.float32, torch.device("cpu"), 64)
    block_size, num_blocks = 16, 10  # block 10 is the null block
    shape = (num_blocks + 1, block_size, arch.num_kv_heads, arch.head_dim)
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
              for _ in range(arch.num_layers)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    graphs = DecodeGraphs(model, caches, CpuAttention(),
                          null_block=num_blocks, block_size=block_size, sizes=[8, 1, 4],
                          max_model_len=64, mode="static")
    # three sequences of 20, 5 and 33 tokens in bucket 4: one padding row
    tables = torch.tensor([[3, 1, 0], [7, 0, 0], [2, 5, 9]], dtype=torch.int32)
    lens = torch.tensor([20, 5, 33], dtype=torch.int32)
    slots = torch.tensor([1 * 16 + 3, 7 * 16 + 4, 9 * 16 + 0])  # position len - 1
    empty = torch.zeros(0, dtype=torch.int32)
    meta = AttentionMetadata(slots, 3, tables, lens, 33, empty.view(0, 0), empty,
                             torch.zeros(1, dtype=torch.int32), 0)
    ids = torch.tensor([4, 8, 15])
    with torch.inference_mode():
        hidden = graphs.run(ids, lens.long() - 1, meta)
    assert graphs.sizes == [1, 4, 8]
    assert hidden.shape == (3, arch.hidden_size) and graphs.bucket(3) == 4
    written = {1 * 16 + 3, 7 * 16 + 4, 9 * 16 + 0}
    for (k, v), (k0, v0) in zip(caches, before):
        changed = ((k != k0).flatten(2).any(-1) | (v != v0).flatten(2).any(-1)).view(-1)
        touched = set(changed.nonzero().view(-1).tolist())
        assert touched - written == {num_blocks * block_size}  # the padding row's one slot
        assert written <= touched
    # the same step through the model directly, without buckets or padding
    with torch.inference_mode():
        direct = model(ids, lens.long() - 1,
                       ForwardContext(meta, before, CpuAttention()))
    torch.testing.assert_close(hidden, direct)


def test_decode_mode_choices_and_enforce_eager(tiny_model):
    from tritonserve.server.__main__ import parse_args
    assert parse_args([]).decode_mode == EngineConfig.decode_mode == "auto"
    assert parse_args(["--enforce-eager"]).decode_mode == "eager"
    with pytest.raises(SystemExit):  # a test fixture, not a mode users choose
        parse_args(["--decode-mode", "static"])
    with pytest.raises(ValueError, match="decode_mode"):
        EngineConfig(decode_mode="cudagraph")  # needs CUDA
    with pytest.raises(ValueError, match="decode_mode"):
        EngineConfig(decode_mode="graphs")
    assert parse_args(["--decode-buckets", "1,8,32"]).decode_buckets == (1, 8, 32)
    with pytest.raises(ValueError, match="decode_buckets"):
        EngineConfig(decode_buckets=(1, 65))  # past max_num_seqs 64
    with pytest.raises(SystemExit):
        parse_args(["--decode-buckets", "1,x"])
    assert LLM(tiny_model, decode_mode="eager").engine.runner.graphs is None
    llm = LLM(tiny_model, decode_mode="static", decode_buckets=(2, 6), max_num_seqs=8)
    assert llm.engine.runner.graphs.sizes == [2, 6]
    calls = count_graph_runs(llm)
    prompts = mixed_prompts(llm.tokenizer, count=8, seed=6)
    short, long = SamplingParams(temperature=0.0, max_tokens=3), SamplingParams(
        temperature=0.0, max_tokens=8)
    outs = llm.generate(prompts, [short] * 3 + [long] * 5)
    assert calls and max(calls) <= 6  # the 8-row steps ran eager, past the largest bucket
    eos = set(llm.engine.eos_token_ids)
    assert_parity([o.token_ids for o in outs],
                  hf_greedy(tiny_model, prompts[:3], 3, eos) + hf_greedy(tiny_model, prompts[3:],
                                                                          8, eos))


@pytest.mark.slow
@pytest.mark.skipif(cpu.op("paged_decode_attention") is None, reason="no C++ toolchain")
def test_compiled_decode_matches_transformers(tiny_model, tmp_path):
    """The compiled step in fp32 (`layers`' fallback): Inductor compiles the forward (fullgraph: the attention, KV
    write, C++ decode and the panel matmuls are tritonserve ops) into two graphs, batch 1 and a
    dynamic batch 2..4: steps of 3 rows run at 3 with no padding and no further compile; fp32
    greedy stays token-identical. A second engine of the same shapes, other weights, reuses the
    graphs (dynamo lifts the weights and caches to graph inputs) and matches its own model."""
    from torch._dynamo.utils import counters
    graphs_before = counters["stats"]["unique_graphs"]
    llm = LLM(tiny_model, dtype="float32", max_num_seqs=4, decode_mode="compile")
    graphs = llm.engine.runner.graphs
    assert graphs.mode == "compile" and graphs.sizes == [1, 4] and graphs.build_seconds > 0
    compiled = counters["stats"]["unique_graphs"] - graphs_before
    assert compiled in (0, 2)  # 0: an earlier test compiled these shapes in this process
    calls = count_graph_runs(llm)
    prompts = mixed_prompts(llm.tokenizer, count=7, seed=4)  # 4 at a time, then 3
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert any(n not in graphs.sizes for n in calls)  # a size between the graphs ran compiled
    assert all(graphs.bucket(n) == n for n in calls)  # at its own size: no padding rows
    assert counters["stats"]["unique_graphs"] - graphs_before == compiled  # no recompile
    assert set(graphs.direct) == set(calls)  # every size's later steps skipped Dynamo
    assert_parity([o.token_ids for o in outs],
                  hf_greedy(tiny_model, prompts, 12, set(llm.engine.eos_token_ids)))
    other = str(write_tiny_model(tmp_path / "other", seed=1))
    again = LLM(other, dtype="float32", max_num_seqs=4, decode_mode="compile")
    assert counters["stats"]["unique_graphs"] - graphs_before == compiled
    other_outs = again.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert again.engine.runner.graphs.direct  # its own inputs: its weights and caches
    assert [o.token_ids for o in other_outs] != [o.token_ids for o in outs]
    assert_parity([o.token_ids for o in other_outs],
                  hf_greedy(other, prompts, 12, set(again.engine.eos_token_ids)))


def test_compiled_bf16_decode_matches_transformers_in_bf16(tiny_model):
    """The compiled step in bf16 (what `auto` runs where layers does not take the model: the
    tiny model's head size has no bf16 attention instance): every
    projection on the bf16 panels (kernels/cpu/linear_bf16.cpp) inside the graph. Against
    transformers in bf16 with the bf16 tie rule (tests/parity.py: a divergence only where the
    reference's top two logits lie within one bf16 step), as the eager bf16 parity test."""
    from tritonserve.engine.models.linear import Linear, has_form
    llm = LLM(tiny_model, dtype="bfloat16", max_num_seqs=4)
    graphs, model = llm.engine.runner.graphs, llm.engine.runner.model
    assert graphs.mode == "compile"
    if has_form("panels", torch.bfloat16):
        assert all(m.weight.dim() == 4 for m in model.modules() if isinstance(m, Linear))
    calls = count_graph_runs(llm)
    prompts = mixed_prompts(llm.tokenizer, count=7, seed=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert calls and all(graphs.bucket(n) == n for n in calls)
    refs = hf_greedy(tiny_model, prompts, 12, set(llm.engine.eos_token_ids), torch.bfloat16)
    ties = assert_parity([o.token_ids for o in outs], refs, TIE_GAP_BF16)
    assert len(ties) <= len(prompts) // 2, ties
    assert_direct_calls_match_dynamo(graphs)


def assert_direct_calls_match_dynamo(graphs: DecodeGraphs) -> None:
    """A size's steps after its first call the compiled graph with the inputs Dynamo gave it
    (DecodeGraphs.direct): on the same static buffers both ways give the same hidden states,
    and new buffer contents reach the direct call (it holds the tensors, not their values)."""
    assert graphs.direct
    for size, direct in graphs.direct.items():
        for seed in (0, 1):  # two sets of token ids, positions inside the first block
            gen = torch.Generator().manual_seed(seed)
            graphs.input_ids[:size].copy_(torch.randint(0, 100, (size,), generator=gen))
            graphs.positions[:size].copy_(torch.randint(0, 4, (size,), generator=gen))
            graphs.seq_lens[:size].copy_(graphs.positions[:size] + 1)
            with torch.inference_mode(), torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                through_dynamo = graphs.runs[size]().clone()
                called = direct().clone()
            assert torch.equal(called, through_dynamo)
            if seed == 0:
                first = called
        assert not torch.equal(first, called)


def test_cudagraph_decode_matches_eager(tiny_model, device):
    """On CUDA (tritonserve/bench/gpu_check.sh runs it): every bucket captured at start-up and
    replayed; greedy tokens identical to the eager engine on the same weights."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    prompts = mixed_prompts(LLM(tiny_model, max_num_seqs=2).tokenizer, count=11, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = {}
    for mode in ("eager", "cudagraph"):
        llm = LLM(tiny_model, device="cuda", dtype="float32", decode_mode=mode, max_num_seqs=12)
        if mode == "cudagraph":
            assert llm.engine.runner.graphs.sizes == [1, 2, 4, 8, 12]
            calls = count_graph_runs(llm)
        runs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    assert calls and max(calls) == 11
    assert runs["cudagraph"] == runs["eager"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_ops_fakes_agree_with_the_ops(dtype):
    """The compiled step runs without Inductor's size asserts (decode_graphs.py): the
    attention ops' fake implementations must give the shapes, strides and dtypes the ops
    return, and store_kv's schema must declare the caches it writes."""
    from tests.test_kernels_attention import make_cache
    k_cache, v_cache = make_cache(6, 16, 2, 64, dtype, "cpu", 2)
    tables = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    q = torch.randn(2, 6, 64).to(dtype)
    kv = torch.randn(2, 2, 64).to(dtype)
    ops = torch.ops.tritonserve
    checks = [
        (ops.store_kv.default, (kv, kv.clone(), k_cache, v_cache,
                                torch.tensor([50, 3], dtype=torch.int64), "torch")),
        (ops.decode_attention.default, (q, k_cache, v_cache, tables, lens, 32, 0.125, "torch")),
        (ops.prefill_attention.default, (torch.randn(5, 6, 64).to(dtype), k_cache, v_cache,
                                         tables, torch.tensor([0, 3, 5], dtype=torch.int32),
                                         lens, 3, 0.125, "torch")),
    ]
    for op, args in checks:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
