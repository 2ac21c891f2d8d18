"""The model's device-dependent ops, each one class with an implementation per device (vLLM's
CustomOp: forward_native / forward_cpu / forward_cuda). `CustomOp.__call__` is the one place
that picks: plain torch while torch.compile traces (Inductor fuses it itself), else by the
first tensor's device. The model files call these and hold no device or compile checks.

forward_native is the reference every other implementation is tested against (kernels/
reference.py holds the same maths); forward_cpu calls the C++ library (kernels/cpu/), falling
back to native where it is not built or does not take the input; forward_cuda the Triton
kernels (kernels/triton/).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from tritonserve.kernels import cpu, quant_layout, reference, triton as triton_kernels
from tritonserve.kernels.triton import quant_matmul


class CustomOp:
    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.forward_native(*args)
        device = args[0].device.type
        if device == "cpu":
            return self.forward_cpu(*args)
        if device == "cuda":
            return self.forward_cuda(*args)
        return self.forward_native(*args)

    def forward_native(self, *args):
        raise NotImplementedError

    def forward_cpu(self, *args):
        return self.forward_native(*args)

    def forward_cuda(self, *args):
        return self.forward_native(*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm (fp32 statistics, weight applied in the input dtype), with
    torch's fused rms_norm: 3 dispatched ops instead of 7."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


class AddRMSNorm(CustomOp):
    """x, residual [T, hidden] -> (rms_norm(residual + x) * weight, residual + x); the fused
    kernels work in place (x and residual are a layer's fresh outputs)."""

    def forward_native(self, x, residual, weight, eps):
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    @staticmethod
    def _fusable(x, residual, weight) -> bool:
        return x.dtype == weight.dtype and x.is_contiguous() and residual.is_contiguous()

    def forward_cpu(self, x, residual, weight, eps):
        if not self._fusable(x, residual, weight) or (op := cpu.op("add_rms_norm")) is None:
            return self.forward_native(x, residual, weight, eps)
        op(x, residual, weight, eps)
        return x, residual

    def forward_cuda(self, x, residual, weight, eps):
        if not self._fusable(x, residual, weight):
            return self.forward_native(x, residual, weight, eps)
        triton_kernels.add_rms_norm(x, residual, weight, eps)
        return x, residual


class SiluAndMul(CustomOp):
    """x [T, 2 * I] -> silu(x[:, :I]) * x[:, I:]."""

    def forward_native(self, x):
        return reference.silu_and_mul(x)

    def forward_cpu(self, x):
        op = cpu.op("silu_and_mul")
        return op(x) if op is not None else self.forward_native(x)

    def forward_cuda(self, x):
        return triton_kernels.silu_and_mul(x)


class Rope(CustomOp):
    """x [T, heads, head_dim] rotated (rotate-half) by cos, sin [T, 1, head_dim]. On the CPU
    in bf16 / fp16 one C++ pass (the eager prefill's rope ~50 -> 17 ms of a 64 x 64 prefill),
    rounded once as the compiled step's fused kernel is; fp32 keeps torch's ops, which the
    greedy parity with transformers is token-identical to."""

    def forward_native(self, x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward_cpu(self, x, cos, sin):
        op = cpu.op("rotary_embedding")
        if op is None or x.dtype not in (torch.bfloat16, torch.float16) or x.stride(-1) != 1:
            return self.forward_native(x, cos, sin)
        return op(x, cos, sin)


@functools.cache
def onednn_runs(dtype: torch.dtype) -> bool:
    """oneDNN's inner product runs this dtype here: fp32 always, bf16 only with native bf16
    kernels (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; on an AVX2-only CPU its bf16 reorder raises)."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    native_bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16 is not None
                                      and bool(native_bf16()))


class PlainLinear(CustomOp):
    """x [M, K] @ weight [N, K]^T (+ bias). On the CPU without autograd, oneDNN's inner
    product instead of F.linear (MKL sgemm): 2.1-2.8x the MKL rate on an AVX-512 EPYC, 442 vs
    204 GFLOP/s at 2048^3. The oneDNN op has no backward, so it is taken only where autograd
    is off (the engine runs under inference_mode)."""

    def forward_native(self, x, weight, bias):
        return F.linear(x, weight, bias)

    def forward_cpu(self, x, weight, bias):
        if torch.is_grad_enabled() or not onednn_runs(x.dtype):
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class QuantLinear(CustomOp):
    """x [M, K] @ a packed quantized weight^T (+ bias) -> [M, N] in x's dtype
    (kernels/quant_layout.py): the C++ tiles on the CPU, the Triton w4a16 / w8a16 matmul on
    CUDA, the dequantized reference elsewhere. A compiled graph calls the C++ op as it is
    (it has a fake: kernels/cpu OPS), not the reference, which would dequantize every step."""

    def __call__(self, x, weight, n, bias):
        if x.device.type == "cpu":
            return self.forward_cpu(x, weight, n, bias)
        return super().__call__(x, weight, n, bias)

    def forward_native(self, x, weight, n, bias):
        return quant_layout.linear(x, weight, n, bias).to(x.dtype)

    def forward_cpu(self, x, weight, n, bias):
        return torch.ops.tritonserve.packed_linear_quant(x.contiguous(), weight, n, bias)

    def forward_cuda(self, x, weight, n, bias):
        return quant_matmul.quant_linear(x, weight, n, bias)


add_rms_norm = AddRMSNorm()
silu_and_mul = SiluAndMul()
rope = Rope()
plain_linear = PlainLinear()
quant_linear = QuantLinear()
