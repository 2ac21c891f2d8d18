"""--kv-cache-dtype int8: each (token, KV head) row as head_dim int8 codes and its fp32 scale
(kernels/reference.py's quantize_kv), written by every store (torch, the compiled step, the
C++ layers op, the Triton kernel) and read by every attention path (the torch reference, the
C++ op's portable kernel, the layers op, the Triton decode and prefill kernels): each path
against the reference on the same int8 cache, the engine's paths against each other, and the
cache holding its share more tokens."""
from __future__ import annotations

import pytest
import torch

from tritonserve.engine import LLM, SamplingParams
from tritonserve.engine.llm import build_config
from tritonserve.kernels import cpu, reference
from tests.test_decode_layers import needs_fp32_op, two_long_then_one, nine_shrinking_to_one
from tests.test_kernels_attention import close, make_cache, poison_tails, scattered_tables

op = cpu.op("paged_decode_attention")
needs_op = pytest.mark.skipif(op is None, reason="no C++ toolchain: the torch path serves")


def test_quantized_rows_round_trip_within_half_a_step():
    x = torch.randn(5, 3, 64) * torch.tensor([1e-3, 1.0, 40.0])[None, :, None]
    x[0, 0] = 0.0  # an all-zero row
    rows = reference.quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 64 + reference.KV_SCALE_BYTES)
    back = reference.dequantize_kv(rows)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(back[0, 0], torch.zeros(64))
    biggest = x.abs().argmax(-1, keepdim=True)  # the largest value of a row is exact
    torch.testing.assert_close(back.gather(-1, biggest), x.gather(-1, biggest))


def _int8_cache(pool, block_size, kv_heads, head_dim, tables, seq_lens, seed):
    k, v = make_cache(pool, block_size, kv_heads, head_dim, torch.float32, "cpu", seed)
    poison_tails(k, v, tables, seq_lens, block_size)  # NaN rows -> NaN scales: never read
    return reference.quantize_kv(k), reference.quantize_kv(v)


def _decode_case(group, seq_lens, block_size, head_dim, dtype, seed, kv_heads=2):
    """One decode query a sequence over an int8 cache of scattered pages: (q, k_cache,
    v_cache, tables, lens)."""
    pool = sum(-(-n // block_size) for n in seq_lens) + 5
    tables = scattered_tables(seq_lens, block_size, pool, seed)
    k_cache, v_cache = _int8_cache(pool, block_size, kv_heads, head_dim, tables, seq_lens, seed)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim).to(dtype)
    return q, k_cache, v_cache, tables, lens


@needs_op
@pytest.mark.parametrize("group, seq_lens, block_size, head_dim, dtype", [
    (3, [5, 200, 64, 70], 16, 64, torch.float32),
    (4, [300, 1, 33], 32, 128, torch.float32),
    (2, [40, 7], 16, 96, torch.float32),  # no specialised build
    (3, [48, 9, 130], 16, 64, torch.bfloat16),  # bf16 queries, int8 cache
    (3, [700], 16, 64, torch.float32),  # one long sequence: split into parts, merged
    # page_group.h's blocks of query heads (3 + 2, 4 + 4, 1), part-filled pages
    (5, [37, 100], 32, 64, torch.float32),
    (8, [50, 15], 16, 128, torch.bfloat16),
    (1, [33, 17, 3], 16, 256, torch.float32),
])
def test_the_cpu_op_reads_an_int8_cache_as_the_reference(group, seq_lens, block_size, head_dim,
                                                         dtype):
    q, k_cache, v_cache, tables, lens = _decode_case(group, seq_lens, block_size, head_dim,
                                                     dtype, 3)
    expected = reference.paged_decode_attention(q.float(), k_cache, v_cache, tables, lens, 0.125)
    close(op(q, k_cache, v_cache, tables, lens, 0.125), expected, dtype)
    # a window: the masked reference on the same cache
    windowed = op(q, k_cache, v_cache, tables, lens, 0.125, False, 50, 0.0)
    cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    close(windowed, reference.paged_attention_masked(q.float(), k_cache, v_cache, tables, cu,
                                                     lens, 0.125, 50, None), dtype)


def test_the_store_writes_quantized_rows_at_their_slots():
    k_cache = torch.zeros(4, 16, 2, 68, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    reference.store_kv_cache(k, v, k_cache, v_cache, torch.tensor([5, -1, 40]))
    assert torch.equal(k_cache.view(-1, 2, 68)[[5, 40]], reference.quantize_kv(k[[0, 2]]))
    assert torch.equal(v_cache.view(-1, 2, 68)[[5, 40]], reference.quantize_kv(v[[0, 2]]))
    assert k_cache.view(-1, 2, 68)[[0, 6, 39]].eq(0).all()  # nothing else written


@needs_fp32_op
def test_the_layers_op_writes_and_reads_int8_rows_as_the_eager_step(tiny_models):
    """The op's rope + quantize in C++ against torch's rope + quantize_kv: codes may differ by
    one where a value sits on a rounding edge, so hidden states within 1e-3 of eager's, at
    batches of 9 down to 1 and over two sequences split into parts."""
    llm = LLM(tiny_models["LlamaForCausalLM"], dtype="float32", decode_mode="eager",
              max_num_seqs=16, kv_cache_dtype="int8")
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.int8
    steps = nine_shrinking_to_one(llm)
    assert max(gap for _, gap, _ in steps) < 1e-3
    llm = LLM(tiny_models["LlamaForCausalLM"], dtype="float32", decode_mode="eager",
              max_num_seqs=4, kv_cache_dtype="int8")
    steps = two_long_then_one(llm, 20)
    assert max(gap for _, gap, _ in steps) < 1e-3


def _greedy(model, **options):
    llm = LLM(model, max_num_seqs=4, **options)
    prompts = [[(5 * i + 3) % 300 for i in range(n)] for n in (7, 40, 120)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                ignore_eos=True, logprobs=1))
    return [o.token_ids for o in outs], [[t.logprob for t in o.logprobs] for o in outs]


@pytest.mark.parametrize("mode", ["layers", "compile"])
def test_the_engine_paths_agree_on_an_int8_cache(tiny_model, mode):
    """eager (the torch store, the C++ op or the reference for attention), the layers op and
    the compiled step on the same int8 cache: the same greedy tokens; and against the fp32
    cache, logprobs within 0.15 (the tiny model, head_dim 16: at most 0.066 measured)."""
    if mode == "layers" and cpu.decode_layers(torch.float32, 16, 2, 16) is None:
        pytest.skip("no C++ toolchain")
    eager_tokens, eager_lp = _greedy(tiny_model, kv_cache_dtype="int8", decode_mode="eager")
    tokens, _ = _greedy(tiny_model, kv_cache_dtype="int8", decode_mode=mode)
    assert tokens == eager_tokens
    fp32_tokens, fp32_lp = _greedy(tiny_model, decode_mode="eager")
    for got, want, a, b in zip(eager_tokens, fp32_tokens, eager_lp, fp32_lp):
        same = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), len(got))
        assert max((abs(x - y) for x, y in zip(a[:same], b[:same])), default=0) < 0.15


def test_an_int8_cache_holds_its_share_more_tokens(tiny_model):
    """The same cache bytes: the tiny model's head_dim 16 rows take 20 bytes in int8 against
    64 in fp32, so 3.2x the blocks (a head_dim 64 model: 68 against 128 in bf16, 1.88x)."""
    budget = 1 << 22
    auto = LLM(tiny_model, dtype="float32", cache_bytes=budget).engine.runner.num_blocks
    int8 = LLM(tiny_model, dtype="float32", cache_bytes=budget,
               kv_cache_dtype="int8").engine.runner.num_blocks
    assert int8 == pytest.approx(auto * 64 / 20, rel=0.02)


def test_bad_options_name_themselves(tiny_model):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        build_config(tiny_model, kv_cache_dtype="fp4")
    from tritonserve.server.__main__ import engine_config, parse_args
    config = engine_config(parse_args(["--model", tiny_model, "--kv-cache-dtype", "int8"]))
    assert config.cache.kv_cache_dtype == "int8" and config.kv_dtype == torch.int8


# ---- the Triton kernels (interpreted here, on CUDA under gpu_check.sh) ------------------------

@pytest.mark.parametrize("group, seq_lens, block_size, head_dim, dtype, splits, window", [
    (3, [5, 40, 17], 16, 64, torch.float32, 1, 0),
    (4, [100, 9], 16, 64, torch.float32, 4, 0),  # split-KV, merged
    (2, [70, 33], 32, 64, torch.bfloat16, 2, 20),  # bf16 queries, a window
])
def test_the_triton_decode_kernel_reads_an_int8_cache_as_the_reference(
        group, seq_lens, block_size, head_dim, dtype, splits, window, device):
    from tritonserve.kernels import triton as kernels
    q, k_cache, v_cache, tables, lens = _decode_case(group, seq_lens, block_size, head_dim,
                                                     dtype, 4)
    if window:
        cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
        expected = reference.paged_attention_masked(q.float(), k_cache, v_cache, tables, cu,
                                                    lens, 0.125, window, None)
    else:
        expected = reference.paged_decode_attention(q.float(), k_cache, v_cache, tables, lens,
                                                    0.125)
    actual = kernels.paged_decode_attention(
        q.to(device), k_cache.to(device), v_cache.to(device), tables.to(device),
        lens.to(device), 0.125, num_splits=splits, window=window or None)
    close(actual.cpu(), expected, dtype)


@pytest.mark.parametrize("group, shapes, block_size, dtype", [
    (3, [(7, 39), (16, 16)], 16, torch.float32),  # a cached prefix, and none
    (4, [(9, 25)], 16, torch.bfloat16),
])
def test_the_triton_prefill_kernel_reads_an_int8_cache_as_the_reference(
        group, shapes, block_size, dtype, device):
    from tritonserve.kernels import triton as kernels
    kv_heads, head_dim = 2, 64
    seq_lens = [s for _, s in shapes]
    pool = sum(-(-n // block_size) for n in seq_lens) + 5
    tables = scattered_tables(seq_lens, block_size, pool, 5)
    k_cache, v_cache = _int8_cache(pool, block_size, kv_heads, head_dim, tables, seq_lens, 5)
    cu = torch.tensor([0] + list(torch.tensor([q for q, _ in shapes]).cumsum(0)),
                      dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), kv_heads * group, head_dim).to(dtype)
    expected = reference.paged_prefill_attention(q.float(), k_cache, v_cache, tables, cu, lens,
                                                 0.125)
    actual = kernels.paged_prefill_attention(
        q.to(device), k_cache.to(device), v_cache.to(device), tables.to(device), cu.to(device),
        lens.to(device), 0.125, tile=(64, 32))
    close(actual.cpu(), expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_store_writes_the_references_int8_rows(dtype, device):
    from tritonserve.kernels import triton as kernels
    blocks, bs, kv_heads, head_dim = 6, 16, 3, 64
    shape = (blocks, bs, kv_heads, head_dim + reference.KV_SCALE_BYTES)
    k_cache = torch.full(shape, 5, dtype=torch.int8)
    v_cache = k_cache.clone()
    k = (torch.randn(9, kv_heads, head_dim) * torch.tensor([0.01, 1.0, 30.0])[:, None]).to(dtype)
    v = torch.randn(9, kv_heads, head_dim).to(dtype)
    k[3, 1] = 0.0  # an all-zero row: scale 1e-30 / 127, codes 0
    slots = torch.tensor([4, -1, 17, 95, 40, 0, -1, 63, 20])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv_cache(k, v, expected_k, expected_v, slots)
    got_k, got_v = k_cache.to(device), v_cache.to(device)
    kernels.store_kv_cache(k.to(device), v.to(device), got_k, got_v, slots.to(device))
    for got, want in ((got_k.cpu(), expected_k), (got_v.cpu(), expected_v)):
        # the scales to the bit; a code may differ by one where x / scale sits on a half
        # (the kernel rounds halves away from zero, torch.round to even)
        assert torch.equal(got[..., head_dim:], want[..., head_dim:])
        diff = (got[..., :head_dim].int() - want[..., :head_dim].int()).abs()
        assert int(diff.max()) <= 1 and float((diff == 0).float().mean()) > 0.999
    untouched = [s for s in range(blocks * bs) if s not in {int(x) for x in slots}]
    assert bool((got_k.cpu().view(-1, kv_heads, shape[-1])[untouched] == 5).all())


def test_the_engine_runs_an_int8_cache_through_the_triton_kernels(tiny_model):
    """The interpreted Triton path end to end (store, prefill, decode) against the torch path
    on the same int8 cache: the same greedy tokens."""
    prompts = [[5, 9, 13, 2, 7] * 4, [11, 3, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("triton", "torch"):
        llm = LLM(str(tiny_model), dtype="float32", kv_cache_dtype="int8",
                  attention_backend=backend, num_blocks=24)
        assert (llm.engine.runner.backend.name == "triton") == (backend == "triton")
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"] and all(len(t) == 6 for t in outs["torch"])
