"""The decoder's matmul, `linear(x, weight, bias)`, and the one-time packing of CPU weights.

A CPU weight is used in one of four forms, chosen once at load (`pack_weight`):
- fp32 with the C++ library: column panels for kernels/cpu/linear.cpp (3-D tensor);
- bf16 with the C++ library: panels of k pairs for kernels/cpu/linear_bf16.cpp (4-D tensor;
  on a Zen 5 EPYC with AVX512-BF16, 1.2-1.4x oneDNN-prepacked at batch 1, 10-25 % faster to
  64 rows, even from 128 to 2048: docs/benchmarks.md, ninth session); an MLP's gate/up the
  same with its rows interleaved 16 / 16, read by `linear_silu_mul` (the activation in the
  matmul's epilogue; `pack_silu_gate_up`, chosen by MLP.fuse_silu);
- otherwise where oneDNN runs the dtype: oneDNN's blocked layout (an mkldnn tensor);
- otherwise plain [N, K] (fp16, CUDA, no oneDNN): F.linear.
Measured on this AMD EPYC (AVX2, 2 threads), SmolLM2's 121 decode matmuls with cold weights:
panels 28.5-29.5 ms at batch 1 (the machine's read bandwidth), oneDNN-prepacked 43-63 ms;
batch 16 62-75 vs 78-94 ms; batch 64 171-180 vs 191-207 ms. Prefill-sized batches (rows in
L2-sized blocks): even with oneDNN-prepacked from 128 to 1024 rows, 15-25 % behind it at 2048,
ahead of unpacking the panels for oneDNN at every size (docs/benchmarks.md).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tritonserve.kernels import cpu_ops

from ..dtype import cpu_has_native_bf16


@functools.cache
def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def _onednn_dtypes() -> tuple[torch.dtype, ...]:
    """fp32 always; bf16 only where oneDNN's bf16 kernels run (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT): on an AVX2-only CPU its bf16 reorder raises, so bf16 stays on F.linear."""
    return (torch.float32, torch.bfloat16) if cpu_has_native_bf16() else (torch.float32,)


def can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN can hold this weight in its blocked layout."""
    return (weight.device.type == "cpu" and weight.dtype in _onednn_dtypes()
            and _onednn_linear_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def prepack_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """weight [N, K] -> the same weight in oneDNN's blocked layout, chosen for batches of about
    `batch_hint` rows. A plain weight is reordered inside every call; prepacked, a batch-64
    SmolLM2 decode step took 92-94 ms instead of 100 (the lm_head: 8.9 ms instead of 13.4)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def _panel_ops(dtype: torch.dtype):
    """(pack, product) of the C++ panel kernel for this dtype, or None."""
    if dtype == torch.float32:
        return cpu_ops.packed_linear()
    if dtype == torch.bfloat16:
        return cpu_ops.packed_linear_bf16()
    return None


def can_pack_panels(weight: torch.Tensor) -> bool:
    """A C++ panel kernel takes this weight (fp32 or bf16 on the CPU, library built)."""
    return weight.device.type == "cpu" and _panel_ops(weight.dtype) is not None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> panels: fp32 [ceil(N / 16), K, 16] for kernels/cpu/linear.cpp, bf16
    [ceil(N / 32), ceil(K / 2), 32, 2] for kernels/cpu/linear_bf16.cpp."""
    return _panel_ops(weight.dtype)[0](weight.detach().contiguous())


def is_panels(weight: torch.Tensor) -> bool:
    return weight.dim() in (3, 4)


def pack_weight(weight: torch.Tensor, batch_hint: int,
                traceable: bool = False) -> torch.Tensor | None:
    """The fastest form `linear` reads for this CPU weight, or None to keep it plain.
    traceable: only a form torch.compile can trace (the panels; oneDNN's tensor is opaque)."""
    if can_pack_panels(weight):
        return pack_panels(weight)
    if can_prepack(weight) and not traceable:
        return prepack_weight(weight, batch_hint)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_features: int | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) -> [M, N]; weight plain or from `pack_weight`
    (panels need out_features = N: their last panel is zero-padded).

    A plain CPU weight in fp32/bf16 goes to oneDNN's inner product directly instead of
    F.linear (MKL sgemm): measured on an AMD EPYC (AVX-512) at 2.1-2.8x the MKL rate, 442 vs
    204 GFLOP/s at 2048^3. The oneDNN op has no backward, so a plain weight takes it only
    where autograd is off (the engine runs under inference_mode), and a packed weight
    refuses an input that needs a gradient."""
    if torch.compiler.is_compiling():
        if weight.dim() == 3:  # panels: the graph calls the C++ op (opaque to Inductor)
            return torch.ops.tritonserve.packed_linear(x, weight, out_features, bias)
        if weight.dim() == 4:
            return torch.ops.tritonserve.packed_linear_bf16(x, weight, out_features, bias)
        return F.linear(x, weight, bias)  # Inductor picks its GEMM
    packed = weight.is_mkldnn or is_panels(weight)
    if packed and torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError("prepacked CPU weights are for inference only")
    if is_panels(weight):
        if out_features is None:
            raise ValueError("linear: out_features is required with a panel-packed weight")
        return _panel_ops(weight.dtype)[1](x.contiguous(), weight, out_features, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if (x.device.type == "cpu" and x.dtype in _onednn_dtypes() and not torch.is_grad_enabled()
            and _onednn_linear_available()):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def can_fuse_silu(weight: torch.Tensor) -> bool:
    """A fused gate/up weight [2I, K] the bf16 gate/up epilogue takes (CPU, bf16, I % 16 == 0,
    library built)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and weight.shape[0] % 32 == 0
            and cpu_ops.packed_linear_silu_mul_bf16() is not None)


def pack_silu_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """weight [2I, K] (gate rows, then up rows) -> the panels of `linear_silu_mul`."""
    return cpu_ops.packed_linear_silu_mul_bf16()[0](weight.detach())


def linear_silu_mul(x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> silu(x @ gate^T) * (x @ up^T) [M, I] from `pack_silu_gate_up` panels: one
    C++ op, the activation computed in the matmul's epilogue (kernels/cpu/linear_bf16.cpp)."""
    if not torch.compiler.is_compiling():
        x = x.contiguous()
    return torch.ops.tritonserve.packed_linear_silu_mul_bf16(x, panels)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.out_features)

    def pack(self, batch_hint: int, traceable: bool = False) -> None:
        """CPU inference: the weight in its packed form (`pack_weight`), in place of the plain
        one; a no-op where no packed form applies or the weight is packed already."""
        if self.weight.is_mkldnn or is_panels(self.weight):
            return
        packed = pack_weight(self.weight, batch_hint, traceable)
        if packed is not None:
            self.weight = nn.Parameter(packed, requires_grad=False)
