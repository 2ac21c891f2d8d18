"""store_kv_cache: scatter new K/V rows into the paged cache; slot -1 (padding) is skipped."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_cache_layout


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
    if row != k_cache.shape[2] * k_cache.shape[3]:
        raise ValueError(f"k rows of {row} elements do not match the cache's "
                         f"{k_cache.shape[2]} x {k_cache.shape[3]}")
    _store_kv_kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0),
                                    v.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row))
