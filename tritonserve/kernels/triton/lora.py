"""LoRA's two products on the GPU, punica's BGMV shape (each row names its adapter's slot):
shrink, xa[t] = x[t] @ A[slot[t]].T ([T, K] -> [T, R], fp32), and expand, y[t, offset:offset
+ N] += xa[t] @ B[slot[t]].T. A is stacked [slots, R, K], B [slots, N, R] (the scale folded
into B, as engine/lora.py keeps it); a row whose slot is -1 (the base model) is left alone. A
program owns one row and a block of R (shrink) or N (expand) outputs and walks the reduced
dimension in blocks, accumulating in fp32 (the interpreter has no bf16 arithmetic). The
contracts are kernels/reference.py's lora_shrink / lora_expand; tests/test_kernels_lora.py
holds them under the interpreter.

Prefill rows come in runs that share an adapter (a request's chunk): the segmented form
(punica's SGMV) takes tiles of up to SGMV_BLOCK_M rows of one run, each a (first row, rows,
slot) triple, and multiplies a tile's rows by its adapter's A or B with tl.dot, so a weight
block is read once a tile instead of once a row. Its contract is the same reference (a row
no tile covers is left alone).

The engine calls them on its Triton path (engine/lora.py's LoraStack: the step's adapters
stacked by slot; batch_of picks the form: SGMV when a run is at least SGMV_MIN_ROWS long).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import compute_in_fp32, dot_precision

SGMV_BLOCK_M = 16  # rows a tile (tl.dot's smallest side)
# A run this long takes the segmented form (a decode step's runs are one row each: BGMV).
# Not measured on a GPU yet: the point where a tile's shared weight reads beat its idle rows.
SGMV_MIN_ROWS = 16


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


@triton.jit
def _tile(tile_ptr):
    """This program's tile of sgmv_tiles: (first row, rows, slot)."""
    tile = tl.program_id(0)
    return (tl.load(tile_ptr + 3 * tile), tl.load(tile_ptr + 3 * tile + 1),
            tl.load(tile_ptr + 3 * tile + 2))


@triton.jit
def _rows_by_wt(rows_ptr, stride_rows, first, m_mask, w_ptr, stride_w, out, out_mask, INNER,
                BLOCK_M: tl.constexpr, BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr,
                FP32: tl.constexpr, PRECISION: tl.constexpr):
    """A tile's rows [first, first + BLOCK_M) of `rows` ([., INNER]) times W^T, W [OUT, INNER]
    (the tile's adapter's A or B): acc [BLOCK_M, BLOCK_OUT] in fp32 over the columns `out`."""
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_OUT], dtype=tl.float32)
    for i0 in range(0, INNER, BLOCK_IN):
        i = i0 + tl.arange(0, BLOCK_IN)
        i_mask = i < INNER
        xv = tl.load(rows_ptr + (first + m)[:, None] * stride_rows + i[None, :],
                     mask=m_mask[:, None] & i_mask[None, :], other=0.0)
        wv = tl.load(w_ptr + out[None, :] * stride_w + i[:, None],
                     mask=i_mask[:, None] & out_mask[None, :], other=0.0)  # W^T block
        if FP32:
            acc += tl.dot(xv.to(tl.float32), wv.to(tl.float32), input_precision=PRECISION)
        else:  # the tensor cores take the adapter's dtype (xa is fp32)
            acc += tl.dot(xv.to(wv.dtype), wv, input_precision=PRECISION)
    return acc


@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, tile_ptr, out_ptr, K, R, stride_x, stride_a_slot,
                        stride_a_r, stride_out, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr, FP32: tl.constexpr, PRECISION: tl.constexpr):
    first, count, slot = _tile(tile_ptr)
    m = tl.arange(0, BLOCK_M)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    m_mask, r_mask = m < count, r < R
    acc = _rows_by_wt(x_ptr, stride_x, first, m_mask, a_ptr + slot * stride_a_slot, stride_a_r,
                      r, r_mask, K, BLOCK_M, BLOCK_R, BLOCK_K, FP32, PRECISION)
    tl.store(out_ptr + (first + m)[:, None] * stride_out + r[None, :], acc,
             mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _sgmv_expand_kernel(xa_ptr, b_ptr, tile_ptr, y_ptr, R, N, offset, stride_xa,
                        stride_b_slot, stride_b_n, stride_y, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, FP32: tl.constexpr,
                        PRECISION: tl.constexpr):
    first, count, slot = _tile(tile_ptr)
    m = tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = m < count, n < N
    acc = _rows_by_wt(xa_ptr, stride_xa, first, m_mask, b_ptr + slot * stride_b_slot,
                      stride_b_n, n, n_mask, R, BLOCK_M, BLOCK_N, BLOCK_R, FP32, PRECISION)
    mask = m_mask[:, None] & n_mask[None, :]
    y = y_ptr + (first + m)[:, None] * stride_y + offset + n[None, :]
    old = tl.load(y, mask=mask, other=0.0)
    tl.store(y, (old.to(tl.float32) + acc).to(old.dtype), mask=mask)


def sgmv_tiles(runs: list[tuple[int, int, int]], device=None) -> torch.Tensor:
    """Runs of rows (first row, rows, slot; slot >= 0) -> the tiles table [T, 3] int32 the
    segmented kernels take: each run cut into SGMV_BLOCK_M-row tiles."""
    tiles = [(first + m0, min(SGMV_BLOCK_M, count - m0), slot)
             for first, count, slot in runs for m0 in range(0, count, SGMV_BLOCK_M)]
    return torch.tensor(tiles, dtype=torch.int32, device=device).reshape(-1, 3)


def sgmv_shrink(x: torch.Tensor, a: torch.Tensor, tiles: torch.Tensor, block_r: int = 16,
                block_k: int = 32) -> torch.Tensor:
    """x [T, K], a [S, R, K], tiles (sgmv_tiles) -> xa [T, R] fp32, zeros in rows no tile
    covers (lora_shrink's contract with those rows' slot -1)."""
    t, k = x.shape
    r = a.shape[1]
    out = torch.zeros(t, r, dtype=torch.float32, device=x.device)
    if tiles.shape[0]:
        _sgmv_shrink_kernel[(tiles.shape[0], triton.cdiv(r, block_r))](
            x, a, tiles, out, k, r, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
            BLOCK_M=SGMV_BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k,
            FP32=compute_in_fp32(x.dtype), PRECISION=dot_precision(x.dtype))
    return out


def sgmv_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, tiles: torch.Tensor,
                offset: int = 0, block_n: int = 64, block_r: int = 16) -> None:
    """y[rows, offset:offset + N] += xa[rows] @ b[slot].T for each tile's rows, in place."""
    r = xa.shape[1]
    n = b.shape[1]
    if tiles.shape[0]:
        _sgmv_expand_kernel[(tiles.shape[0], triton.cdiv(n, block_n))](
            xa, b, tiles, y, r, n, offset, xa.stride(0), b.stride(0), b.stride(1), y.stride(0),
            BLOCK_M=SGMV_BLOCK_M, BLOCK_N=block_n, BLOCK_R=block_r,
            FP32=compute_in_fp32(b.dtype), PRECISION=dot_precision(b.dtype))
