"""The decoder's matmul, `Linear`, and the one-time packing of its weight into the form the
decode plan names (engine/plan.py: `weights`).

A weight is used in one of five forms, `weight_form(weight)` tells which:
- plain [N, K]: `ops.plain_linear` (oneDNN's inner product on the CPU, F.linear elsewhere);
- onednn: oneDNN's blocked layout (an mkldnn tensor), where there are no C++ panels;
- panels: the C++ panel kernels, fp32 [ceil(N / 16), K, 16] for kernels/cpu/linear.cpp, bf16
  [ceil(N / 32), ceil(K / 2), 32, 2] for kernels/cpu/linear_bf16.cpp (on a Zen 5 EPYC with
  AVX512-BF16, 1.2-1.4x oneDNN-prepacked at batch 1, 10-25 % faster to 64 rows, even from 128
  to 2048: docs/perf-log/2026-cpu-decode.md);
- quant: weight-only quantized panels, uint8 (kernels/quant_layout.py: a GGUF file's Q4_0 /
  Q4_1 / Q8_0 blocks as they are), for kernels/cpu/linear_quant.cpp in fp32 or bf16 and
  kernels/triton/quant_matmul.py on CUDA; loaded already packed (engine/models/gguf.py,
  compressed.py) or quantized at load (decoder.quantize_weights), never packed here;
- silu panels: an MLP's gate/up as bf16 panels with its rows interleaved 16 / 16, the
  activation in the matmul's epilogue (`Linear.fuse_silu`): [M, K] -> silu(gate) * up [M, I].
Panels against oneDNN-prepacked on an AVX2 EPYC (2 threads), SmolLM2's 121 decode matmuls with
cold weights: 28.5-29.5 vs 43-63 ms at batch 1 (the machine's read bandwidth), 62-75 vs 78-94
at 16, 171-180 vs 191-207 at 64; prefill-sized batches even from 128 to 1024 rows.
"""
from __future__ import annotations

import torch
from torch import nn

from tritonserve.kernels import cpu, quant_layout

from .ops import onednn_runs, plain_linear, quant_linear

PANEL_DTYPES = (torch.float32, torch.bfloat16)


def weight_form(weight: torch.Tensor) -> str:
    if weight.is_mkldnn:
        return "onednn"
    if quant_layout.kind_of(weight) is not None:
        return "quant"
    return {2: "plain", 3: "panels", 4: "panels"}[weight.dim()]


def pack(weight: torch.Tensor, form: str, batch_hint: int) -> torch.Tensor:
    """weight [N, K] -> the same weight in `form` (panels, onednn; plain: as it is). onednn
    is chosen for batches of about `batch_hint` rows: prepacked, a batch-64 SmolLM2 decode
    step took 92-94 ms instead of 100 (the lm_head: 8.9 ms instead of 13.4)."""
    weight = weight.detach()
    if form == "panels":
        ops = cpu.panel_ops(weight.dtype)
        if ops is None:
            raise ValueError(f"no C++ panels for {weight.dtype} here")
        return ops[0](weight.contiguous())
    if form == "onednn":
        if not onednn_runs(weight.dtype):
            raise ValueError(f"oneDNN does not run {weight.dtype} here")
        return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_features: int | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N], the weight in any form of `pack`
    (panels need out_features = N: their last panel is zero-padded). A packed weight has no
    backward: it refuses an input that needs a gradient."""
    form = weight_form(weight)
    if form == "plain":
        return plain_linear(x, weight, bias)
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError("prepacked CPU weights are for inference only")
    if form == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if out_features is None:
        raise ValueError("linear: out_features is required with a panel-packed weight")
    if form == "quant":  # C++ on the CPU, Triton on CUDA (ops.QuantLinear)
        return quant_linear(x, weight, out_features, bias)
    # a weight in panels means the library is loaded: the op itself (a compiled graph calls
    # it as it is), fp32 panels 3-D, bf16 4-D
    product = (torch.ops.tritonserve.packed_linear_bf16 if weight.dim() == 4
               else torch.ops.tritonserve.packed_linear)
    return product(x.contiguous(), weight, out_features, bias)


class Linear(nn.Linear):
    silu_in_matmul = False  # gate/up as silu panels: forward gives silu(gate) * up
    # a row-parallel projection's sum over tensor-parallel ranks, in place (engine/parallel.py:
    # Shard.all_reduce), or None
    reduce = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu_in_matmul:
            return torch.ops.tritonserve.packed_linear_silu_mul_bf16(x.contiguous(),
                                                                     self.weight)
        y = linear(x, self.weight, self.bias, self.out_features)
        if self.reduce is not None:
            self.reduce(y)
        return y

    def pack(self, form: str, batch_hint: int) -> None:
        """The weight in `form` in place of the plain one; a no-op once packed."""
        if weight_form(self.weight) == "plain" and form != "plain":
            self.weight = nn.Parameter(pack(self.weight, form, batch_hint), requires_grad=False)

    def fuse_silu(self) -> bool:
        """A gate/up weight [2I, K] (gate rows, then up rows) as silu panels, where they apply
        (bf16 panels, I a multiple of 16); returns whether the activation is in the matmul.
        One op instead of two, and no [T, 2I] activation."""
        weight = self.weight
        if not self.silu_in_matmul and can_fuse_silu(weight):
            self.weight = nn.Parameter(cpu.pack_gate_up_bf16(weight.detach()),
                                       requires_grad=False)
            self.silu_in_matmul = True
        return self.silu_in_matmul


def can_fuse_silu(weight: torch.Tensor) -> bool:
    return (weight.dtype == torch.bfloat16 and weight_form(weight) == "plain"
            and weight.shape[0] % 32 == 0
            and cpu.op("packed_linear_silu_mul_bf16") is not None)


def has_form(form: str, dtype: torch.dtype) -> bool:
    """`pack` can put a CPU weight of this dtype in `form` here."""
    if form == "panels":
        return cpu.panel_ops(dtype) is not None
    if form == "quant":  # loaded or quantized already packed, never by `pack`
        return dtype in PANEL_DTYPES and cpu.op("packed_linear_quant") is not None
    return form == "plain" or (form == "onednn" and onednn_runs(dtype))
