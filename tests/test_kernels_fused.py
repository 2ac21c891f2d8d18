"""The fused elementwise ops (residual add + RMSNorm, SiLU x mul) against transformers' Llama
formulation written out here: the Triton kernels (interpreted on the CPU, on CUDA in
gpu_check), the C++ CPU ops, and kernels.reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tritonserve.kernels import triton as kernels

from tritonserve.kernels import cpu, reference

CPU_OPS = (cpu.op("add_rms_norm"), cpu.op("silu_and_mul"))
IMPLS = {"triton": (kernels.add_rms_norm, kernels.silu_and_mul),
         "reference": (reference.add_rms_norm, reference.silu_and_mul)}
if CPU_OPS is not None:
    IMPLS["cpp"] = CPU_OPS
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def llama_add_norm(x, residual, weight, eps):
    """transformers: hidden = residual + x; LlamaRMSNorm(hidden)."""
    hidden = residual + x
    h = hidden.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), hidden


def run_on(impl, device):
    if impl == "cpp" and device != "cpu":
        pytest.skip("the C++ ops are CPU only")


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 96), (3, 576), (2, 100)])  # 100: a tail
def test_add_rms_norm(impl, dtype, rows, hidden, device):
    run_on(impl, device)
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype).to(device)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype).to(device)
    expected, expected_sum = llama_add_norm(x, residual, weight, 1e-5)
    x_in, r_in = x.clone(), residual.clone()
    IMPLS[impl][0](x_in, r_in, weight, 1e-5)  # in place
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(r_in, expected_sum, atol=tol, rtol=tol)
    torch.testing.assert_close(x_in, expected, atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inner", [(1, 64), (4, 1536), (2, 100)])
def test_silu_and_mul(impl, dtype, rows, inner, device):
    run_on(impl, device)
    gen = torch.Generator().manual_seed(rows + inner)
    x = (torch.randn(rows, 2 * inner, generator=gen) * 4).to(dtype).to(device)
    gate, up = x[:, :inner], x[:, inner:]
    expected = F.silu(gate) * up
    got = IMPLS[impl][1](x)
    assert got.shape == (rows, inner) and got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, expected, atol=tol * 4, rtol=tol)


def test_silu_and_mul_reads_a_strided_view(device):
    """The gate/up projection's output sliced from a wider buffer: rows not contiguous."""
    wide = torch.randn(3, 300, device=device)
    x = wide[:, :200]
    for name, (_, silu_and_mul) in IMPLS.items():
        if name == "cpp" and device != "cpu":
            continue
        torch.testing.assert_close(silu_and_mul(x), F.silu(x[:, :100]) * x[:, 100:])


def test_bad_shapes_name_the_problem():
    with pytest.raises(ValueError, match="add_rms_norm"):
        kernels.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="silu_and_mul"):
        kernels.silu_and_mul(torch.zeros(2, 7))


@pytest.mark.skipif(CPU_OPS is None, reason="the C++ ops could not be built")
def test_cpp_bf16_ops_round_like_torch_at_prefill_size():
    """The C++ ops' bf16 loops convert on raw bits and use a polynomial exp (vectorised):
    at a 64-prompt prefill's shape nearly every element equals torch's rounding exactly, and
    none is more than one bf16 step off; NaN stays NaN, huge gates neither overflow nor vanish."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(700, 2 * 1536, generator=gen) * 4).to(torch.bfloat16)
    x[0, :4] = torch.tensor([float("nan"), 1e30, -1e30, 90.0])
    got, expected = CPU_OPS[1](x), F.silu(x[:, :1536]) * x[:, 1536:]
    assert got[0, 0].isnan() and got[0, 1:4].isfinite().all()
    torch.testing.assert_close(got[0, 1:4], expected[0, 1:4])
    rest, want = got[1:].float(), expected[1:].float()
    assert (rest != want).float().mean() < 1e-4
    assert within_bf16_steps(rest, want)
    for width in (576, 600):  # AVX-512 rows of 32 / 16, then (600) a tail of 8 one at a time
        h = (torch.randn(700, width, generator=gen) * 3).to(torch.bfloat16)
        r = torch.randn(700, width, generator=gen).to(torch.bfloat16)
        w = (torch.rand(width, generator=gen) + 0.5).to(torch.bfloat16)
        norm, total = llama_add_norm(h, r, w, 1e-5)
        CPU_OPS[0](h, r, w, 1e-5)
        assert torch.equal(r, total)  # the sum is one rounding: exact
        # the row's statistic is summed in another order: where that moves the normalised
        # value across a rounding boundary, the weight's product can land two steps away
        assert (h != norm).float().mean() < 1e-4
        assert within_bf16_steps(h.float(), norm.float(), 2)


def within_bf16_steps(a, b, steps=1):
    """every element of a within `steps` bf16 rounding steps of b's (8 significant bits)"""
    return bool(((a - b).abs() <= torch.maximum(a.abs(), b.abs()) * steps * 2 ** -7).all())
