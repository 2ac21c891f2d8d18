"""The bf16 panel matmul C++ ops (kernels/cpu/panels_bf16.h, panels_amx.h through
linear_bf16.cpp) against the float64 product: row tiles and tails, AMX tiles where the CPU has
them, the gate/up epilogue, work splits, and the refusals."""
from __future__ import annotations

import pytest
import torch

from tritonserve.kernels import cpu, reference
from tests.test_cpu_ops import needs_op


@needs_op
@pytest.mark.parametrize("rows,n,k", [
    (1, 70, 64), (1, 33, 301),  # one row: the four-chain loop, its odd-pair tail, odd K
    (5, 165, 301), (12, 32, 2), (29, 100, 577),  # partial and full row tiles, partial panels
    (300, 40, 500), (1, 1, 1), (3, 64, 1536),  # two row blocks (252 + 48 rows); K = 1
    # outputs past 1 MB, written with non-temporal stores: every row 64-byte aligned (an
    # lm_head's shape), and rows of odd length (only some rows aligned; a partial panel)
    (24, 24576, 40), (17, 16411, 33),
])
def test_bf16_panels_round_the_exact_product_once(rows, n, k):
    """packed_linear_bf16 sums in fp32 over all of K and rounds once: every element is the
    float64 product rounded to bf16, give or take one bf16 step (fp32 sums of <= 1536 terms
    sit ~1e-6 off the exact value, so only near-ties round the other way, and near-zero
    results off by the sum's rounding). With a bias (a
    Qwen2 qkv bias is bf16) the same against product + bias."""
    x, weight, panels = _bf16_product_once(rows, n, k)
    assert panels.shape == (-(-n // 32), -(-k // 2), 32, 2)


def _bf16_product_once(rows: int, n: int, k: int):
    """Random x [rows, k], weight [n, k] and a bias, packed; asserts packed_linear_bf16 gives
    the float64 product (+ bias) rounded to bf16 within one bf16 step and the fp32 sum's error,
    with and without the bias; returns (x, weight, panels)."""
    pack, product = cpu.panel_ops(torch.bfloat16)
    generator = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    weight = (torch.randn(n, k, generator=generator) / k ** 0.5).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16()
    panels = pack(weight)
    for b in (None, bias):
        out = product(x, panels, n, b)
        assert out.shape == (rows, n) and out.dtype == torch.bfloat16
        exact = x.double() @ weight.double().t() + (0 if b is None else b.double())
        step = exact.abs().clamp_min(1e-30).log2().floor().exp2() / 128  # one bf16 ulp
        # and the fp32 sum's own error, which only shows where the terms nearly cancel (a
        # result ~1e-6 from terms ~1: one element of the 590,000 in the 24 x 24,576 case)
        slack = 2 ** -22 * (x.double().abs() @ weight.double().abs().t())
        assert ((out.double() - exact).abs() <= step + slack).all()
        assert (out.double() - exact.bfloat16().double()).abs().gt(0).float().mean() < 0.01
    return x, weight, panels


@pytest.fixture(params=[False, True], ids=["avx512", "amx"])
def amx_tiles(request):
    """The bf16 panel matmuls with AMX tiles off, then on (skipped where the CPU, the OS or
    the build has none); restored after."""
    before = cpu.amx_enabled()
    if cpu.set_amx(request.param) != request.param:
        cpu.set_amx(before)
        pytest.skip("no AMX-BF16 here")
    yield request.param
    cpu.set_amx(before)


@needs_op
@pytest.mark.parametrize("rows,n,k", [
    (4, 70, 64), (16, 33, 576), (17, 1000, 96),  # one tile, a tile and a staged tail row
    (33, 64, 1536), (64, 1536, 576),  # a pair and a partial tile; SmolLM2's o / gate shapes
    (300, 130, 64),  # prefill-sized: row blocks of whole tile pairs, then a staged tail
    (24, 24576, 64),  # an output past 1 MB: non-temporal rows
])
def test_bf16_panels_on_amx_tiles_round_the_exact_product_once(amx_tiles, rows, n, k):
    """Shapes the AMX tiles take (K a multiple of 32, 4 rows or more): on the tiles and off
    them, every element is the float64 product (+ bias) rounded to bf16 within one bf16 step
    and the fp32 sum's error, as test_bf16_panels_round_the_exact_product_once asks; with
    the tiles on, rows past M (a partial last tile) never reach the output, and the gate/up
    epilogue matches the unfused path through the same tiles."""
    assert cpu.amx_enabled() == amx_tiles
    pack, product = cpu.panel_ops(torch.bfloat16)
    x, weight, panels = _bf16_product_once(rows, n, k)
    generator = torch.Generator().manual_seed(rows + n)
    # a row's result does not depend on the rows around it (the tail's padding included)
    assert torch.equal(product(x[:rows - 1], panels, n, None), product(x, panels, n, None)[:-1])
    inter = 16 * (n // 16 + 1)
    pack_gate_up, fused = (cpu.pack_gate_up_bf16, cpu.op("packed_linear_silu_mul_bf16"))
    gate_up = (torch.randn(2 * inter, k, generator=generator) * 4 / k ** 0.5).bfloat16()
    unfused = reference.silu_and_mul(product(x * 3, pack(gate_up), 2 * inter, None))
    diff = (fused(x * 3, pack_gate_up(gate_up)).double() - unfused.double()).abs()
    assert (diff <= unfused.double().abs().clamp_min(1e-30).log2().floor().exp2() / 128
            + 1e-30).all()


@needs_op
def test_bf16_panels_refuse_mismatched_inputs():
    pack, product = cpu.panel_ops(torch.bfloat16)
    panels = pack(torch.randn(40, 16).bfloat16())
    with pytest.raises(RuntimeError, match="K = x.size"):
        product(torch.randn(2, 18).bfloat16(), panels, 40, None)
    with pytest.raises(RuntimeError, match="N does not match"):
        product(torch.randn(2, 16).bfloat16(), panels, 20, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        product(torch.randn(2, 16), panels, 40, None)


@needs_op
@pytest.mark.parametrize("rows,inter,k", [
    (1, 48, 64), (1, 16, 301),  # one row: its own loop; odd K
    (5, 48, 301), (13, 32, 2), (64, 1536, 576),  # one tile, two tiles, SmolLM2's shape
    (300, 64, 40),  # two row blocks
])
def test_bf16_gate_up_epilogue_matches_the_unfused_path(rows, inter, k):
    """packed_linear_silu_mul_bf16 is the gate/up matmul with silu(gate) * up in its
    epilogue: the same bf16 roundings as the unfused path (matmul stored in bf16, F.silu in
    bf16, the product rounded), so every element matches it within one bf16 step, almost all
    exactly (the two exp implementations may differ in fp32's last bit). Inputs large enough
    that silu saturates at both ends."""
    pack, fused = (cpu.pack_gate_up_bf16, cpu.op("packed_linear_silu_mul_bf16"))
    generator = torch.Generator().manual_seed(rows * 100 + inter)
    x = (torch.randn(rows, k, generator=generator) * 3).bfloat16()
    weight = (torch.randn(2 * inter, k, generator=generator) * 4 / k ** 0.5).bfloat16()
    out = fused(x, pack(weight))
    assert out.shape == (rows, inter) and out.dtype == torch.bfloat16
    pack_plain, product = cpu.panel_ops(torch.bfloat16)
    unfused = reference.silu_and_mul(product(x, pack_plain(weight), 2 * inter, None))
    diff = (out.double() - unfused.double()).abs()
    step = unfused.double().abs().clamp_min(1e-30).log2().floor().exp2() / 128
    assert (diff <= step + 1e-30).all()
    assert diff.gt(0).double().mean() < 1e-3


@needs_op
@pytest.mark.parametrize("threads", [2, 3, 5])
@pytest.mark.parametrize("rows,n", [(1, 70), (64, 1000), (7, 16411)])
def test_bf16_panels_do_not_depend_on_the_work_split(threads, rows, n):
    """Decode-sized matmuls hand each thread its panels and let a thread that is done take
    the others' from their back (owned_panels.h): whoever computes a panel, every output is
    the one a single thread writes, and no panel is skipped (more threads than cores, panel
    counts that do not split evenly; bf16, its gate/up epilogue, and fp32)."""
    pack, product = cpu.panel_ops(torch.bfloat16)
    pack_gate_up, fused = (cpu.pack_gate_up_bf16, cpu.op("packed_linear_silu_mul_bf16"))
    generator = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, 96, generator=generator).bfloat16()
    weight = (torch.randn(n, 96, generator=generator) / 10).bfloat16()
    gate_up = (torch.randn(2 * 48 * (n // 48 + 1), 96, generator=generator) / 10).bfloat16()
    panels, gate_up_panels = pack(weight), pack_gate_up(gate_up)
    pack32, product32 = cpu.panel_ops(torch.float32)
    panels32 = pack32(weight.float())
    ops = [lambda: product(x, panels, n, None), lambda: fused(x, gate_up_panels),
           lambda: product32(x.float(), panels32, n, None)]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = [op() for op in ops]
        torch.set_num_threads(threads)
        for _ in range(3):
            for op, out in zip(ops, expected):
                assert torch.equal(op(), out)
    finally:
        torch.set_num_threads(before)


@needs_op
def test_bf16_gate_up_packing_refuses_what_the_epilogue_cannot_take():
    pack, fused = (cpu.pack_gate_up_bf16, cpu.op("packed_linear_silu_mul_bf16"))
    with pytest.raises(ValueError, match="I % 16"):
        pack(torch.randn(2 * 24, 8).bfloat16())  # I = 24
    with pytest.raises(ValueError, match="bf16"):
        pack(torch.randn(64, 8))
    with pytest.raises(RuntimeError, match="K = x.size"):
        fused(torch.randn(3, 10).bfloat16(), pack(torch.randn(64, 8).bfloat16()))
