"""w4a16 / w8a16: x [M, K] (bf16, fp16 or fp32) @ a weight-only quantized weight^T, the weight
read in the packed layout the CPU kernels read (kernels/quant_layout.py: panels of 16 output
columns, records of 32 k with fp16 scale d and offset m; u4 codes d * q + m, s8 codes d * q,
s8h codes (d * s) * q with an int8 s a half group, s8hm (d * s) * q + m),
so a GGUF file's blocks, a compressed-tensors checkpoint or int4 / int8 quantized at load
reach the GPU as the same bytes. Each program owns BLOCK_M rows x BLOCK_N columns and walks K
a group of 32 at a time: the group's codes widened in registers, scaled by its d (and m), one
tl.dot on the tensor cores in the input dtype (fp32 accumulation). The contract is
quant_layout.linear's (the dequantized reference).

The layout was made for AVX-512 lanes, not for coalescing: a warp's 32 lanes read 16 columns'
words of one k block (64 contiguous bytes) per load, a panel's record being 320 (544, 576,
608) bytes.
bench/gpu_check.sh reports the share of HBM bandwidth at batch 1 and of the bf16 tensor-core
rate at batch 64 (not yet run on a GPU).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritonserve.kernels import quant_layout

from ._common import compute_in_fp32, dot_precision


@triton.jit
def widen_group(w8_ptr, w16_ptr, w32_ptr, base, col, n_mask, KIND: tl.constexpr,
                CODES_AT: tl.constexpr):
    """One group of 32 k of BLOCK_N columns -> their weights [32, BLOCK_N] in fp32: base, the
    columns' record byte offsets [BLOCK_N] (col: each one's place in its panel). KIND and
    CODES_AT, the kind's id and codes' start, are quant_layout.KINDS' (kernel_args): 0 u4,
    1 s8, 2 s8h, 3 s8hm."""
    k = tl.arange(0, 32)
    d = tl.load(w16_ptr + base // 2 + col, mask=n_mask, other=0.0).to(tl.float32)
    if KIND == 0:
        # u4: k = 8 b + 2 i + h sits in block b's word of the column at bits 4 (i + 4 h)
        word_at = 16 * (k // 8)
        shift = 4 * ((k % 8) // 2 + 4 * (k % 2))
        m = tl.load(w16_ptr + base // 2 + 16 + col, mask=n_mask, other=0.0).to(tl.float32)
        words = tl.load(w32_ptr + ((base + CODES_AT) // 4 + col)[None, :] + word_at[:, None],
                        mask=n_mask[None, :], other=0)
        q = ((words >> shift[:, None]) & 15).to(tl.float32)
        w = q * d[None, :] + m[None, :]
    elif KIND == 1:
        q = tl.load(w8_ptr + (base + 32 + col)[None, :] + 16 * k[:, None],
                    mask=n_mask[None, :], other=0).to(tl.float32)
        w = q * d[None, :]
    else:  # s[h][c] 32 + 16 h + c bytes before the codes, h = k // 16
        s = tl.load(w8_ptr + (base + CODES_AT - 32 + col)[None, :] + 16 * (k // 16)[:, None],
                    mask=n_mask[None, :], other=0).to(tl.float32)
        q = tl.load(w8_ptr + (base + CODES_AT + col)[None, :] + 16 * k[:, None],
                    mask=n_mask[None, :], other=0).to(tl.float32)
        w = (d[None, :] * s) * q
        if KIND == 3:
            m = tl.load(w16_ptr + base // 2 + 16 + col, mask=n_mask, other=0.0).to(tl.float32)
            w = w + m[None, :]
    return w


@triton.jit
def _quant_matmul_kernel(x_ptr, w8_ptr, w16_ptr, w32_ptr, bias_ptr, out_ptr, M, N, K,
                         stride_xm, stride_om, KIND: tl.constexpr, RECORD: tl.constexpr,
                         CODES_AT: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr,
                         PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    panel = (offs_n // 16).to(tl.int64)
    col = offs_n % 16
    k = tl.arange(0, 32)
    groups = K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, groups):
        base = (panel * groups + g) * RECORD  # [BLOCK_N] byte offsets of the records
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + g * 32 + k[None, :],
                    mask=m_mask[:, None], other=0.0)
        w = widen_group(w8_ptr, w16_ptr, w32_ptr, base, col, n_mask, KIND, CODES_AT)
        if FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision=PRECISION)
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


KINDS = {k.name: k.id for k in quant_layout.KINDS}


def kernel_args(kind: str) -> dict[str, int]:
    """The kernel's constexprs for `kind`, read from quant_layout's table."""
    named = quant_layout.BY_NAME[kind]
    return dict(KIND=named.id, RECORD=named.record_bytes, CODES_AT=named.codes_at)


def block_shape(rows: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): a decode batch in one row tile of 16 (tl.dot's least), wider
    batches in tiles of 64."""
    return (16, 64) if rows <= 16 else (64, 64)


def quant_linear(x: torch.Tensor, weight: torch.Tensor, n: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ the packed weight (uint8 [ceil(N / 16), K / 32, record])^T (+ bias [N])
    -> [M, N] in x's dtype."""
    kind = quant_layout.kind_of(weight)
    if kind is None:
        raise ValueError("quant_linear: weight is not a packed quantized weight")
    rows, k = x.shape
    if weight.shape[1] * quant_layout.GROUP != k or weight.shape[0] * quant_layout.COLS < n:
        raise ValueError(f"quant_linear: x [{rows}, {k}] does not match the weight "
                         f"{tuple(weight.shape)} for {n} outputs")
    x = x.contiguous()
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_m, block_n = block_shape(rows)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    _quant_matmul_kernel[grid](
        x, weight.view(torch.int8), weight.view(torch.float16), weight.view(torch.int32),
        bias if bias is not None else out, out, rows, n, k, x.stride(0), out.stride(0),
        **kernel_args(kind), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        FP32=compute_in_fp32(x.dtype), PRECISION=dot_precision(x.dtype))
    return out
