"""The Triton fused-MoE kernel (kernels/triton/fused_moe.py) under the interpreter against
kernels/reference.fused_moe: dense experts in fp32 and bf16 (loaded as bf16, computed in fp32
as the interpreter must), 4-bit (u4) and 8-bit (s8) packed experts, each also with gpt-oss's
biases and clamped SwiGLU; and `align`, which gives
every tile one expert and pads each expert's run."""
from __future__ import annotations

import os

import pytest
import torch

from tritonserve.engine.models.moe import route
from tritonserve.kernels import quant_layout, reference

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1"
                                and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or CUDA")


def _case(tokens=3, experts=4, top_k=2, hidden=64, inter=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1
    down = torch.randn(experts, hidden, inter, generator=g) * 0.1
    ids, weights = route(torch.randn(tokens, experts, generator=g), top_k, normalize=True)
    return x, gate_up, down, ids, weights


def test_align_gives_each_tile_one_expert():
    from tritonserve.kernels.triton.fused_moe import align
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    rows, tile_expert = align(ids, 4, 4)
    assert tile_expert.tolist() == [0, 1, 2]  # expert 3 chosen by none: no tile
    flat = ids.reshape(-1)
    for tile, expert in enumerate(tile_expert.tolist()):
        chunk = rows[tile * 4:(tile + 1) * 4]
        real = chunk[chunk < flat.numel()]
        assert (flat[real] == expert).all()
    assert sorted(rows[rows < 6].tolist()) == list(range(6))


@pytest.mark.parametrize("form", ["fp32", "bf16", "u4", "s8"])
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_fused_moe_equals_the_reference(form, gpt_oss):
    """gpt_oss: with gate/up and down biases (in the GEMMs' epilogue), top-k-then-softmax
    routing and the clamped SwiGLU."""
    from tritonserve.kernels.triton.fused_moe import fused_moe, takes
    x, gate_up, down, ids, weights = _case()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if form in ("u4", "s8"):
        stored = [torch.stack([quant_layout.quantize(w, form) for w in t]) for t in (gate_up, down)]
        gate_up, down = (torch.stack([quant_layout.dequantize(w, n) for w in s])
                         for s, n in zip(stored, (gate_up.shape[1], down.shape[1])))
    else:
        dtype = torch.float32 if form == "fp32" else torch.bfloat16
        stored = [gate_up.to(dtype), down.to(dtype)]
        gate_up, down = (t.float() for t in stored)
        x = x.to(dtype)
    assert takes(*stored)
    extras = ()
    if gpt_oss:
        g = torch.Generator().manual_seed(5)
        extras = (torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g), 0.5, 1.702)
        ids, weights = route(torch.randn(3, 4, generator=g), 2, False, softmax_last=True)
    got = fused_moe(x.to(device), ids.to(device), weights.to(device),
                    *(s.to(device) for s in stored), 32,
                    *(e.to(device) if torch.is_tensor(e) else e for e in extras))
    want = reference.fused_moe(x.float(), gate_up, down, ids, weights, *extras)
    tol = 3e-2 if form == "bf16" else 1e-4
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)
