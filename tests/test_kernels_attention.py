"""Attention and KV-write kernels against their torch references, on fresh random inputs.

Tolerances (max abs error on unit-scale random data): fp32 1e-4; fp16 2e-3; bf16 1.5e-2 with
rtol 1e-2 (interpreter bf16 is cast to fp32 after load, so only storage rounding differs).
"""
from __future__ import annotations

import pytest
import torch

from tritonserve.kernels import triton as kernels

from tritonserve.kernels import reference

TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3),
             torch.bfloat16: (1.5e-2, 1e-2)}
POISON = float("nan")


def make_cache(num_blocks, block_size, kv_heads, head_dim, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype).to(device)
    v = torch.randn(shape, generator=gen).to(dtype).to(device)
    return k, v


def scattered_tables(seq_lens, block_size, pool, seed):
    """Block tables drawn at random (without reuse) from a pool larger than needed."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(pool, generator=gen)
    width = max(blocks)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for row, nb in enumerate(blocks):
        table[row, :nb] = perm[used:used + nb]
        used += nb
    assert used <= pool
    return table


def poison_tails(k_cache, v_cache, tables, seq_lens, block_size):
    """Slots past each sequence's end hold NaN: a kernel that reads them fails."""
    for row, n in enumerate(seq_lens):
        last = int(tables[row, (n - 1) // block_size])
        k_cache[last, n % block_size or block_size:] = POISON
        v_cache[last, n % block_size or block_size:] = POISON


def close(actual, expected, dtype):
    atol, rtol = TOLERANCE[dtype]
    assert not torch.isnan(actual).any(), "an output element was never written"
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


DECODE_CASES = [
    # (group, seq_lens, block_size, head_dim, dtype, num_splits)
    (1, [1, 16, 37], 16, 64, torch.float32, 1),
    (4, [5, 32, 64, 70], 16, 64, torch.float32, 1),
    (8, [1, 33, 96], 32, 128, torch.float32, 1),
    (4, [100, 17, 256], 16, 64, torch.float32, 4),
    (8, [300, 1], 32, 64, torch.float32, 2),
    (4, [48, 9], 16, 64, torch.float16, 2),
    (4, [48, 9], 16, 128, torch.bfloat16, 1),
    (2, [40, 7], 16, 96, torch.float32, 1),
    (4, [1100, 40], 16, 64, torch.float32, 16),  # many splits, some of them empty
]


@pytest.mark.parametrize("group,seq_lens,block_size,head_dim,dtype,num_splits", DECODE_CASES)
def test_paged_decode_attention(group, seq_lens, block_size, head_dim, dtype, num_splits,
                                device):
    kv_heads = 2
    seed = hash((group, tuple(seq_lens), head_dim, num_splits)) % 1000
    pool = sum(-(-n // block_size) for n in seq_lens) + 11
    k_cache, v_cache = make_cache(pool, block_size, kv_heads, head_dim, dtype, device, seed)
    tables = scattered_tables(seq_lens, block_size, pool, seed).to(device)
    poison_tails(k_cache, v_cache, tables, seq_lens, block_size)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim,
                    generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(device)
    expected = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1)
    actual = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1,
                                            num_splits=num_splits,
                                            out=torch.full_like(q, POISON))
    close(actual, expected, dtype)


def test_split_heuristic_splits_small_long_batches_only():
    cpu = torch.device("cpu")
    assert kernels.choose_num_splits(1, 8, 4096, cpu) > 1  # few programs, long context
    assert kernels.choose_num_splits(64, 8, 4096, cpu) == 1  # grid already full
    assert kernels.choose_num_splits(1, 8, 200, cpu) == 1  # too short to be worth a split
    assert kernels.choose_num_splits(1, 1, 1 << 20, cpu) == kernels.MAX_SPLITS  # capped
    # batch 1, 8 KV heads, 4096 tokens: at least one program per SM, >= 128 tokens a split
    splits = kernels.choose_num_splits(1, 8, 4096, cpu)
    assert 8 * splits >= kernels.num_sms(0) and 4096 // splits >= kernels.MIN_TOKENS_PER_SPLIT
    assert splits & (splits - 1) == 0
    # length bounds the splits: 1024 tokens give at most 8
    assert kernels.choose_num_splits(1, 8, 1024, cpu) == 8


PREFILL_CASES = [
    # (group, [(q_len, seq_len)], block_size, head_dim, dtype)
    (1, [(5, 5), (16, 16), (20, 20)], 16, 64, torch.float32),  # no cached prefix
    (4, [(7, 39), (1, 17), (16, 48)], 16, 64, torch.float32),  # cached prefix / chunks
    (8, [(33, 33), (12, 44)], 32, 128, torch.float32),
    (4, [(9, 25), (18, 18)], 16, 64, torch.float16),
    (4, [(9, 25), (18, 18)], 16, 64, torch.bfloat16),
    (3, [(70, 70), (5, 90)], 16, 96, torch.float32),  # padded group and head_dim, full tiles
]


@pytest.mark.parametrize("group,shapes,block_size,head_dim,dtype", PREFILL_CASES)
def test_paged_prefill_attention(group, shapes, block_size, head_dim, dtype, device):
    kv_heads = 2
    seed = hash((group, tuple(shapes), head_dim)) % 1000
    seq_lens = [s for _, s in shapes]
    pool = sum(-(-n // block_size) for n in seq_lens) + 7
    k_cache, v_cache = make_cache(pool, block_size, kv_heads, head_dim, dtype, device, seed)
    tables = scattered_tables(seq_lens, block_size, pool, seed).to(device)
    poison_tails(k_cache, v_cache, tables, seq_lens, block_size)
    cu = torch.tensor([0] + list(torch.tensor([q for q, _ in shapes]).cumsum(0)),
                      dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(int(cu[-1]), kv_heads * group, head_dim,
                    generator=torch.Generator().manual_seed(seed + 2)).to(dtype).to(device)
    expected = reference.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.125)
    # a fixed tile: on CUDA, autotuning every case would compile 7 configs per dtype and
    # shape (minutes of gpu_check.sh); test_prefill_autotuned_launch covers the tuner
    actual = kernels.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.125,
                                             out=torch.full_like(q, POISON), tile=(64, 32))
    close(actual, expected, dtype)


def test_prefill_autotuned_launch(device):
    """tile=None: the autotuner on CUDA (every config run once), the default tile when
    interpreted; either way the reference's answer."""
    kv_heads, group, head_dim, block_size, dtype = 2, 4, 128, 16, torch.bfloat16
    seq_lens, q_lens = [70, 33], [70, 20]
    pool = sum(-(-n // block_size) for n in seq_lens) + 2
    k_cache, v_cache = make_cache(pool, block_size, kv_heads, head_dim, dtype, device, 8)
    tables = scattered_tables(seq_lens, block_size, pool, 8).to(device)
    poison_tails(k_cache, v_cache, tables, seq_lens, block_size)
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim).to(dtype).to(device)
    expected = reference.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.1)
    close(kernels.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.1,
                                          out=torch.full_like(q, POISON)), expected, dtype)


@pytest.mark.parametrize("tile", [(64, 32), (128, 64), (64, 128)])
def test_prefill_tile_shapes_agree(tile, device):
    """Each tuned shape (rows, keys) computes the same thing: a long prompt after a cached
    prefix crosses full key tiles, diagonal tiles and several query tiles."""
    kv_heads, group, head_dim, block_size = 1, 4, 64, 16
    seq_lens, q_lens = [150, 40], [90, 40]
    pool = sum(-(-n // block_size) for n in seq_lens) + 3
    k_cache, v_cache = make_cache(pool, block_size, kv_heads, head_dim, torch.float32,
                                  device, 5)
    tables = scattered_tables(seq_lens, block_size, pool, 5).to(device)
    poison_tails(k_cache, v_cache, tables, seq_lens, block_size)
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim).to(device)
    expected = reference.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.125)
    actual = kernels.paged_prefill_attention(q, k_cache, v_cache, tables, cu, lens, 0.125,
                                             out=torch.full_like(q, POISON), tile=tile)
    close(actual, expected, torch.float32)


def test_prefill_matches_dense_causal_attention(device):
    """Independent of the reference: one sequence in scattered blocks equals SDPA on the
    contiguous tensors."""
    seq_len, heads, head_dim, bs = 29, 4, 64, 16
    k = torch.randn(seq_len, heads, head_dim)
    v = torch.randn(seq_len, heads, head_dim)
    q = torch.randn(seq_len, heads, head_dim)
    k_cache = torch.full((6, bs, heads, head_dim), POISON)
    v_cache = torch.full((6, bs, heads, head_dim), POISON)
    table = torch.tensor([[4, 1]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(seq_len)])
    kernels.store_kv_cache(k.to(device), v.to(device), k_cache := k_cache.to(device),
                           v_cache := v_cache.to(device), slots.to(device))
    out = kernels.paged_prefill_attention(
        q.to(device), k_cache, v_cache, table.to(device),
        torch.tensor([0, seq_len], dtype=torch.int32, device=device),
        torch.tensor([seq_len], dtype=torch.int32, device=device), head_dim ** -0.5)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    torch.testing.assert_close(out.cpu(), dense.transpose(0, 1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_kv_cache_exact_and_skips_padding(dtype, device):
    num_blocks, bs, kv_heads, head_dim = 8, 16, 2, 64
    k_cache = torch.full((num_blocks, bs, kv_heads, head_dim), 7.0, dtype=dtype, device=device)
    v_cache = k_cache.clone()
    tokens = 10
    k = torch.randn(tokens, kv_heads, head_dim).to(dtype).to(device)
    v = torch.randn(tokens, kv_heads, head_dim).to(dtype).to(device)
    slots = torch.tensor([5, -1, 17, 127, 64, -1, 0, 33, 90, 15], device=device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv_cache(k, v, expected_k, expected_v, slots)
    kernels.store_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    flat = k_cache.view(-1, kv_heads, head_dim)
    written = {int(s) for s in slots if s >= 0}
    untouched = [i for i in range(num_blocks * bs) if i not in written]
    assert bool((flat[untouched] == 7.0).all()), "a slot that was not asked for changed"


def test_prefill_autotuner_keeps_each_dtypes_space():
    from tritonserve.kernels.triton import prefill_attention as pa
    configs = pa._tuned_prefill_kernel.configs
    for fp32 in (True, False):
        kept = pa._prune(configs, {}, FP32=fp32)
        shapes = {(c.kwargs["BLOCK_M"], c.kwargs["TILE_N"], c.num_warps, c.num_stages)
                  for c in kept}
        assert shapes == set(pa.tuning_space(fp32)) and len(kept) == len(shapes)
    # every tuned shape holds a whole query position of the largest supported group
    assert min(c.kwargs["BLOCK_M"] for c in configs) >= pa.MAX_GROUP
