"""The mixture-of-experts MLP on CUDA: vLLM's fused_moe scheme in two grouped GEMM launches.

1. `align`: the T x k (token, expert) choices sorted by expert, each expert's run padded to a
   multiple of BLOCK_M with a sentinel, and the expert of every BLOCK_M tile: a tile's rows
   all use one expert's weights, so a program reads one expert's tile of weights and an
   expert no token chose is read by no program.
2. gate/up: [T k, 2I] = x[token] @ gate_up[e]^T, one launch over (tiles, 2I / BLOCK_N).
3. silu(gate) * up (fused_elementwise's silu_and_mul; gpt-oss's clamped SwiGLU in torch).
4. down: [T k, H] = h @ down[e]^T, one launch, each row times its routing weight in the
   kernel's epilogue; then the k rows of a token summed.
gpt-oss's expert biases are added in each GEMM's epilogue (BIAS).

The experts are bf16 / fp16 / fp32 [E, N, K] or the packed quantized layout the CPU reads
(kernels/quant_layout.py: w4a16 u4, w8a16 s8, and the GGUF kinds s8h / s8hm), stacked
[E, panels, K / 32, record]: their groups widened in registers as quant_matmul.py widens them.
The contract is reference.fused_moe. bench/gpu_check.sh reports its share of HBM bandwidth
at batch 1 and 64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritonserve.kernels import quant_layout, reference

from ._common import compute_in_fp32, dot_precision
from .fused_elementwise import silu_and_mul
from .quant_matmul import kernel_args, widen_group

BLOCK_K_DENSE = 32


def align(ids: torch.Tensor, experts: int, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (rows [tiles * block_m]: the flat choice t * k + j, expert-sorted, each
    expert's run padded with T * k; tile_expert [tiles]: each tile's expert)."""
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    order = torch.argsort(flat, stable=True)
    starts = torch.cumsum(padded, 0) - padded  # each expert's first padded row
    run_starts = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    position = starts[sorted_experts] + (torch.arange(flat.numel(), device=flat.device)
                                         - run_starts[sorted_experts])
    total = int(padded.sum())
    rows = torch.full((total,), flat.numel(), dtype=torch.int64, device=flat.device)
    rows[position] = order
    tile_expert = torch.repeat_interleave(torch.arange(experts, device=flat.device),
                                          padded // block_m)
    return rows, tile_expert


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, w8_ptr, w16_ptr, w32_ptr, out_ptr, rows_ptr, tile_expert_ptr,
                     weights_ptr, bias_ptr, N, K, valid, stride_am, stride_we, stride_wn,
                     stride_wk, expert_bytes, A_DIVISOR: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                     BIAS: tl.constexpr,
                     KIND: tl.constexpr, RECORD: tl.constexpr, CODES_AT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     FP32: tl.constexpr, PRECISION: tl.constexpr):
    """out[r] = (a[r // A_DIVISOR] @ w[e]^T + bias[e]) (times weights[r]) for the rows r of
    one expert tile; KIND -1: dense w [E, N, K], else a quant_layout kind (its id); BIAS: an
    fp32 bias [E, N]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < valid
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    a_rows = (rows // A_DIVISOR).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if KIND < 0:
        w_base = w_ptr + expert * stride_we
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + kk < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + (k0 + kk)[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + offs_n[None, :] * stride_wn + (k0 + kk)[:, None] * stride_wk,
                        mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if FP32:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
            else:
                acc += tl.dot(a, w.to(a.dtype))
    else:  # quant_matmul.py's widening, from this expert's panels (BLOCK_K is 32: a group)
        panel = (offs_n // 16).to(tl.int64)
        col = offs_n % 16
        groups = K // 32
        e0 = expert * expert_bytes
        for g in range(0, groups):
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + g * 32 + kk[None, :],
                        mask=row_ok[:, None], other=0.0)
            w = widen_group(w8_ptr, w16_ptr, w32_ptr, e0 + (panel * groups + g) * RECORD, col,
                            n_ok, KIND, CODES_AT)
            if FP32:
                acc += tl.dot(a.to(tl.float32), w, input_precision=PRECISION)
            else:
                acc += tl.dot(a, w.to(a.dtype))
    if BIAS:
        acc += tl.load(bias_ptr + expert * N + offs_n, mask=n_ok, other=0.0)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + rows, mask=row_ok, other=0.0)[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def takes(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """The kernel reads these stacked experts: dense [E, N, K] or packed [E, P, G, record]."""
    def one(w):
        return (w.dim() == 3 and w.is_floating_point()) or (
            w.dim() == 4 and quant_layout.kind_of(w[0]) is not None)
    return one(gate_up) and one(down)


def block_m_for(tokens: int, top_k: int, experts: int) -> int:
    """16 rows a tile while an expert gets few rows (decode), 64 once tiles fill."""
    return 16 if tokens * top_k <= 4 * experts * 16 else 64


def _gemm(a, w, rows, tile_expert, weights, n, valid, divisor, block_m, out_dtype,
          bias=None):
    k = a.shape[1]
    out = torch.zeros((valid, n), dtype=out_dtype, device=a.device)
    kind = quant_layout.kind_of(w[0]) if w.dim() == 4 else None
    args = dict(KIND=-1, RECORD=0, CODES_AT=0) if kind is None else kernel_args(kind)
    block_n = 64 if n >= 64 else 32
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    dense = kind is None
    _moe_gemm_kernel[grid](
        a, w, w.view(torch.int8) if not dense else a, w.view(torch.float16) if not dense else a,
        w.view(torch.int32) if not dense else a, out, rows, tile_expert, weights,
        a if bias is None else bias.float().contiguous(), n, k, valid,
        a.stride(0), w.stride(0) if dense else 0, w.stride(1) if dense else 0,
        w.stride(2) if dense else 0, 0 if dense else w[0].numel(),
        A_DIVISOR=divisor, MUL_WEIGHT=weights is not None, BIAS=bias is not None, **args,
        BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=32 if not dense else BLOCK_K_DENSE,
        FP32=compute_in_fp32(a.dtype), PRECISION=dot_precision(a.dtype))
    return out


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              gate_up: torch.Tensor, down: torch.Tensor, inter: int,
              gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              swiglu_limit: float = 0.0, swiglu_alpha: float = 1.702) -> torch.Tensor:
    """x [T, H], ids / weights [T, k], stacked experts (`takes`), gpt-oss's biases and
    SwiGLU limit -> [T, H] in x's dtype: reference.fused_moe."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    if tokens == 0:
        return torch.empty_like(x)
    x = x.contiguous()
    block_m = block_m_for(tokens, top_k, gate_up.shape[0])
    rows, tile_expert = align(ids, gate_up.shape[0], block_m)
    valid = tokens * top_k
    h = _gemm(x, gate_up, rows, tile_expert, None, 2 * inter, valid, top_k, block_m, x.dtype,
              gate_up_bias)
    act = (reference.swiglu_clamped(h, swiglu_limit, swiglu_alpha) if swiglu_limit > 0
           else silu_and_mul(h))
    flat_weights = weights.reshape(-1).float().contiguous()
    y = _gemm(act.contiguous(), down, rows, tile_expert, flat_weights, hidden, valid, 1,
              block_m, torch.float32, down_bias)
    return y.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
