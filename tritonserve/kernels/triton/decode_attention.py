"""paged_decode_attention: one new query token per sequence over its paged KV cache.

Grid: (sequence, KV head, split). One program packs the G query heads that share a KV head
into the rows of a tl.dot, so each K/V tile is loaded once per group, not once per head.
Each iteration covers TILE_N tokens (several pages), gathering their slots through the block
table, rather than one page at a time.
Split-KV (flash-decoding): when sequences x KV heads cannot fill the GPU and contexts are long,
each program covers a slice of the context and a second kernel merges the slices with
log-sum-exp. Heuristic (choose_num_splits): split only when the grid has fewer than 2 programs
per SM; then enough splits to give every SM two programs (the SM count is the device's), as
long as each split keeps at least MIN_TOKENS_PER_SPLIT tokens (two 64-token tiles). At batch 1
with 8 KV heads and 4,096 tokens that is 32 splits (256 programs on 132 SMs); a fixed cap of
8 (as SGLang has) left half of an H200's SMs idle there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (attention_shapes, compute_in_fp32, dot_precision, int8_scales,
                      load_kv_tile, num_sms, online_softmax_update)

MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 64  # a power of two: the merge kernel reads the splits as one tl.arange


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                   seq_lens_ptr,
                   out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, scale, window, softcap,
                   sinks_ptr, stride_qs, stride_qh, stride_bts, stride_cb, stride_ct, stride_ch,
                   stride_os, stride_oh,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, FP32: tl.constexpr,
                   PRECISION: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAPPED: tl.constexpr,
                   INT8: tl.constexpr, SINKS: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first = 0  # the first visible token: the window's, whose earlier tiles are never read
    if WINDOWED:
        first = tl.maximum(seq_len - window, 0)
    skipped = first // TILE_N
    num_tiles = tl.cdiv(seq_len, TILE_N) - skipped
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    first_tile = skipped + split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, skipped + num_tiles)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(first_tile, last_tile):
        # a tile of TILE_N tokens spans TILE_N / BLOCK_SIZE pages: gather their slots
        pos = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N]
        valid = (pos < seq_len) & (pos >= first)  # slots past seq_len may hold anything
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                            block_tables_ptr + seq * stride_bts, pos, valid, d, d_mask, kv_head,
                            stride_cb, stride_ct, stride_ch, BLOCK_SIZE, True, FP32, INT8,
                            HEAD_DIM)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, TILE_N]
        if SOFTCAPPED:  # softcap * tanh(s / softcap), tanh as 1 - 2 / (e^2x + 1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_update(s, v, m_i, l_i, acc, PRECISION)

    if NUM_SPLITS == 1:
        if SINKS:  # each head's sink logit in the denominator, weighing no value
            l_i += tl.exp(tl.load(sinks_ptr + heads, mask=g_mask, other=0.0) - m_i)
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        num_heads = NUM_KV_HEADS * GROUP
        row = (seq * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc,
                 mask=g_mask[:, None])
        tl.store(part_max_ptr + row, m_i, mask=g_mask)
        tl.store(part_sum_ptr + row, l_i, mask=g_mask)


@triton.jit
def _merge_splits_kernel(part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, sinks_ptr,
                         stride_os, stride_oh, NUM_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, SINKS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + sp  # [NUM_SPLITS]
    maxes = tl.load(part_max_ptr + row)
    sums = tl.load(part_sum_ptr + row)
    accs = tl.load(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :])  # [NUM_SPLITS, BLOCK_D]
    global_max = tl.max(maxes, axis=0)
    weights = tl.exp(maxes - global_max)  # empty splits have max -inf -> weight 0
    total = tl.sum(weights * sums, axis=0)
    if SINKS:
        total += tl.exp(tl.load(sinks_ptr + head) - global_max)
    out = tl.sum(accs * weights[:, None], axis=0) / total
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def tile_tokens(block_size: int, dtype: torch.dtype) -> int:
    """Tokens per loop iteration: several pages at once (vLLM and SGLang use 32-64), so each
    iteration has more bytes in flight than one 16-token page gives."""
    return max(block_size, 32 if dtype == torch.float32 else 64)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      device: torch.device) -> int:
    programs = num_seqs * num_kv_heads
    target = 2 * num_sms(device.index or 0)
    if programs >= target or max_seq_len < 2 * MIN_TOKENS_PER_SPLIT:
        return 1
    by_fill = -(-target // programs)
    by_length = max_seq_len // MIN_TOKENS_PER_SPLIT
    return triton.next_power_of_2(min(MAX_SPLITS, by_fill, by_length) + 1) // 2 or 1


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, max_seq_len: int | None = None,
                           out: torch.Tensor | None = None, window: int | None = None,
                           softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [num_seqs, num_heads, head_dim] -> out of the same shape. num_splits overrides the
    heuristic (a power of two); max_seq_len avoids reading seq_lens back from the device.
    window / softcap / sinks: reference.paged_attention_masked's (the tiles before the
    window are not read)."""
    block_size, num_kv_heads, group = attention_shapes(q, k_cache, v_cache)
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        num_splits = choose_num_splits(num_seqs, num_kv_heads,
                                       min(max_seq_len, window or max_seq_len), q.device)
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    block_d = triton.next_power_of_2(head_dim)
    int8, k_scale, v_scale = int8_scales(k_cache, v_cache)
    sinks_arg = q if sinks is None else sinks.float().contiguous()  # q: an unread pointer
    if num_splits > 1:
        rows = num_seqs * num_heads * num_splits
        part_acc = torch.empty(rows, block_d, dtype=torch.float32, device=q.device)
        part_max = torch.empty(rows, dtype=torch.float32, device=q.device)
        part_sum = torch.empty(rows, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_max = part_sum = out  # unused
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, out, part_acc, part_max,
        part_sum, scale,
        window or 0, softcap or 0.0, sinks_arg, q.stride(0), q.stride(1),
        block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_SIZE=block_size, TILE_N=tile_tokens(block_size, q.dtype),
        NUM_SPLITS=num_splits, FP32=compute_in_fp32(q.dtype) or int8,
        PRECISION=dot_precision(q.dtype), WINDOWED=bool(window), SOFTCAPPED=bool(softcap),
        INT8=int8, SINKS=sinks is not None)
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_acc, part_max, part_sum, out, sinks_arg, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            SINKS=sinks is not None)
    return out
