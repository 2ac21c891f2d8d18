"""LoRA's two products on the GPU, punica's BGMV shape (each row names its adapter's slot):
shrink, xa[t] = x[t] @ A[slot[t]].T ([T, K] -> [T, R], fp32), and expand, y[t, offset:offset
+ N] += xa[t] @ B[slot[t]].T. A is stacked [slots, R, K], B [slots, N, R] (the scale folded
into B, as engine/lora.py keeps it); a row whose slot is -1 (the base model) is left alone. A
program owns one row and a block of R (shrink) or N (expand) outputs and walks the reduced
dimension in blocks, accumulating in fp32 (the interpreter has no bf16 arithmetic). The
contracts are kernels/reference.py's lora_shrink / lora_expand; tests/test_kernels_lora.py
holds them under the interpreter.

The engine calls them on its Triton path (engine/lora.py's LoraStack: the step's adapters
stacked by slot). Not yet: the segmented (SGMV) form for prefill rows that share an adapter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, out_ptr, K, R, stride_x, stride_a_slot, stride_a_r,
                   stride_out, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = (r < R) & ((tl.zeros([BLOCK_R], dtype=tl.int32) + slot) >= 0)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xv = tl.load(x_ptr + row * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
        av = tl.load(a_ptr + slot * stride_a_slot + r[:, None] * stride_a_r + k[None, :],
                     mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(out_ptr + row * stride_out + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(xa_ptr, b_ptr, slot_ptr, y_ptr, R, N, offset, stride_xa, stride_b_slot,
                   stride_b_n, stride_y, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (n < N) & ((tl.zeros([BLOCK_N], dtype=tl.int32) + slot) >= 0)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < R
        xv = tl.load(xa_ptr + row * stride_xa + r, mask=r_mask, other=0.0)
        bv = tl.load(b_ptr + slot * stride_b_slot + n[:, None] * stride_b_n + r[None, :],
                     mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(bv * xv[None, :], axis=1)
    y = y_ptr + row * stride_y + offset + n
    old = tl.load(y, mask=n_mask, other=0.0)
    tl.store(y, (old.to(tl.float32) + acc).to(old.dtype), mask=n_mask)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor,
                block_r: int = 16, block_k: int = 64) -> torch.Tensor:
    """x [T, K], a [S, R, K], slots [T] int32 (-1: none) -> xa [T, R] fp32 (0 where -1)."""
    t, k = x.shape
    r = a.shape[1]
    out = torch.zeros(t, r, dtype=torch.float32, device=x.device)
    if t:
        _shrink_kernel[(t, triton.cdiv(r, block_r))](
            x, a, slots, out, k, r, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
            BLOCK_R=block_r, BLOCK_K=block_k)
    return out


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                offset: int = 0, block_n: int = 64, block_r: int = 16) -> None:
    """y[:, offset:offset + N] += xa @ b[slot].T per row, in place; y [T, >= offset + N],
    xa [T, R] fp32, b [S, N, R]."""
    t, r = xa.shape
    n = b.shape[1]
    if t:
        _expand_kernel[(t, triton.cdiv(n, block_n))](
            xa, b, slots, y, r, n, offset, xa.stride(0), b.stride(0), b.stride(1), y.stride(0),
            BLOCK_N=block_n, BLOCK_R=block_r)
