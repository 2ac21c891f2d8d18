"""Fused elementwise kernels of a decoder layer, one program per row:

add_rms_norm(x, residual, weight, eps): in place, residual += x; x = weight * rms_norm(residual)
    (one read and one write of each row instead of the add, the norm's passes and the scale)
silu_and_mul(x) -> out: x [T, 2I] -> silu(x[:, :I]) * x[:, I:]

Numerics as transformers' Llama and kernels.reference: fp32 statistics, the residual sum and
the normalised row rounded to the tensor dtype where the reference rounds them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, stride_x, stride_r, hidden, eps,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + row * stride_r + offs, s, mask=mask)
    s = s.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / hidden + eps)
    normed = (s * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * stride_x + offs, (w * normed).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, inner, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < inner
        gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + inner + offs, mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, (silu * up).to(out_ptr.dtype.element_ty),
                 mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> None:
    """x, residual [T, hidden] (rows contiguous), weight [hidden]; both updated in place."""
    if x.shape != residual.shape or x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"add_rms_norm needs x, residual [T, H] and weight [H], got "
                         f"{tuple(x.shape)}, {tuple(residual.shape)}, {tuple(weight.shape)}")
    if x.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError("add_rms_norm needs rows with unit stride")
    if x.shape[0] == 0:
        return
    hidden = x.shape[1]
    _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight, x.stride(0), residual.stride(0),
                                        hidden, eps, BLOCK=triton.next_power_of_2(hidden))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] -> [T, I]"""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul needs x [T, 2 * I], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    inner = x.shape[1] // 2
    out = torch.empty(x.shape[0], inner, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0],)](x, out, x.stride(0), out.stride(0), inner,
                                            BLOCK=min(1024, triton.next_power_of_2(inner)))
    return out
