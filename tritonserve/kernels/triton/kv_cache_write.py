"""store_kv_cache: scatter new K/V rows into the paged cache; slot -1 (padding) is skipped.
An int8 cache (--kv-cache-dtype int8) gets each (token, KV head) row quantized as
kernels/reference.py's quantize_kv does: head_dim codes, then the fp32 scale (absmax / 127)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_cache_layout, int8_scales


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_vt, ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + token * stride_kt + offs, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + offs, mask=mask)
        dst = slot * ROW + offs  # a slot is kv_heads * head_dim contiguous elements
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows(x_ptr, cache_ptr, scale_ptr, src, rows, d, mask, h_mask,
                   HEAD_DIM: tl.constexpr):
    """One token's rows [BLOCK_H, BLOCK_D] from x_ptr + src into int8 rows at byte `rows`
    [BLOCK_H]: codes, and the fp32 scale at (rows + HEAD_DIM) / 4 of the cache seen as fp32."""
    x = tl.load(x_ptr + src, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30) / 127.0  # [BLOCK_H]
    c = x / scale[:, None]
    c = tl.where(c >= 0, tl.floor(c + 0.5), tl.ceil(c - 0.5))  # to nearest
    c = tl.minimum(tl.maximum(c, -127.0), 127.0).to(tl.int8)
    tl.store(cache_ptr + rows[:, None] + d[None, :], c, mask=mask)
    tl.store(scale_ptr + (rows + HEAD_DIM) // 4, scale, mask=h_mask)


@triton.jit
def _store_kv_int8_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                          slot_ptr, stride_kt, stride_vt, KV_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_mask = h < KV_HEADS
        mask = h_mask[:, None] & (d < HEAD_DIM)[None, :]
        src = h[:, None] * HEAD_DIM + d[None, :]
        rows = slot * (KV_HEADS * (HEAD_DIM + 4)) + h * (HEAD_DIM + 4)  # a row's first byte
        _quantize_rows(k_ptr + token * stride_kt, k_cache_ptr, k_scale_ptr, src, rows, d, mask,
                       h_mask, HEAD_DIM)
        _quantize_rows(v_ptr + token * stride_vt, v_cache_ptr, v_scale_ptr, src, rows, d, mask,
                       h_mask, HEAD_DIM)


def store_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, head_dim]; caches [blocks, block_size, kv_heads, head_dim];
    slot_mapping [T] int (block * block_size + offset, -1 = skip)."""
    check_cache_layout(k_cache, v_cache)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k = k.reshape(num_tokens, -1)
    v = v.reshape(num_tokens, -1)
    if k.stride(1) != 1 or v.stride(1) != 1:
        k, v = k.contiguous(), v.contiguous()
    row = k.shape[1]
    if k_cache.dtype == torch.int8:
        int8, k_scale, v_scale = int8_scales(k_cache, v_cache)
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3] - 4
        if row != kv_heads * head_dim:
            raise ValueError(f"k rows of {row} elements do not match the int8 cache's "
                             f"{kv_heads} x {head_dim}")
        _store_kv_int8_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, k.stride(0), v.stride(0),
            KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim))
        return
    if row != k_cache.shape[2] * k_cache.shape[3]:
        raise ValueError(f"k rows of {row} elements do not match the cache's "
                         f"{k_cache.shape[2]} x {k_cache.shape[3]}")
    _store_kv_kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0),
                                    v.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row))
