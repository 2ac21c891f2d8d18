"""Helpers shared by the kernel launchers."""
from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def compute_in_fp32(dtype: torch.dtype) -> bool:
    """The interpreter has no bf16 arithmetic (a bf16 tl.dot is silently wrong): cast after
    loading. fp32 inputs also compute in fp32 (with exact, not tf32, dots)."""
    return interpreting() or dtype == torch.float32


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if compute_in_fp32(dtype) else "tf32"


@lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():
        return 132  # an H100/H200-sized default for the interpreter's heuristics
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@triton.jit
def online_softmax_update(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One tile of flash attention's recurrence: scores s [R, N] (masked keys at -inf) and
    values v [N, D] folded into the running max m_i [R], sum l_i [R] and acc [R, D]."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_row_ptr, pos, valid,
                 d, d_mask, kv_head, stride_cb, stride_ct, stride_ch, BLOCK_SIZE: tl.constexpr,
                 MASKED: tl.constexpr, FP32: tl.constexpr, INT8: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    """K and V [N, D] of a sequence's token positions pos [N], gathered through its block
    table row (table_row_ptr): each position's page, then its slot in the page, for one KV
    head. MASKED: positions where `valid` is false read as 0 (their slots may hold anything,
    even NaN); unmasked, every position must be < the sequence's length. FP32: cast to fp32
    (the interpreter's bf16 dot is wrong). INT8: the caches hold int8 rows (HEAD_DIM codes,
    then the row's fp32 scale: kernels/reference.py's quantize_kv); k_scale_ptr / v_scale_ptr
    are the same caches seen as fp32, where the scale of the row at byte r is (r + HEAD_DIM)
    / 4; the values come back as codes x scale in fp32."""
    if MASKED:
        block = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0)
        kv_mask = valid[:, None] & d_mask[None, :]
    else:
        block = tl.load(table_row_ptr + pos // BLOCK_SIZE)
        kv_mask = d_mask[None, :]
    row = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
    k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if INT8:
        at = (row + HEAD_DIM) // 4
        if MASKED:
            k_scale = tl.load(k_scale_ptr + at, mask=valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + at, mask=valid, other=0.0)
        else:
            k_scale = tl.load(k_scale_ptr + at)
            v_scale = tl.load(v_scale_ptr + at)
        k = k.to(tl.float32) * k_scale[:, None]
        v = v.to(tl.float32) * v_scale[:, None]
    elif FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


def int8_scales(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """(int8, k_scale, v_scale): an int8 cache's fp32 views for load_kv_tile's scales (its
    rows are head_dim + 4 bytes, whole fp32 words where head_dim % 4 == 0); the caches
    themselves otherwise (not read)."""
    if k_cache.dtype != torch.int8:
        return False, k_cache, v_cache
    if k_cache.shape[-1] % 4:
        raise ValueError(f"an int8 KV cache needs head_dim % 4 == 0, got rows of "
                         f"{k_cache.shape[-1]} bytes")
    return True, k_cache.view(torch.float32), v_cache.view(torch.float32)


def check_cache_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def attention_shapes(q: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, num_kv_heads, group) of an attention call, q [T, num_heads, head_dim]
    checked against the caches' layout and heads."""
    check_cache_layout(k_cache, v_cache)
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if k_cache.dtype == torch.int8:  # rows of head_dim codes + a 4-byte scale
        cache_head_dim -= 4
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads {num_heads} x {head_dim} do not fit cache KV heads "
                         f"{num_kv_heads} x {cache_head_dim}")
    return block_size, num_kv_heads, num_heads // num_kv_heads


next_power_of_2 = triton.next_power_of_2
__all__ = ["tl", "triton", "interpreting", "compute_in_fp32", "dot_precision", "num_sms",
           "check_cache_layout", "attention_shapes", "load_kv_tile", "int8_scales", "next_power_of_2",
           "online_softmax_update"]
