"""kernels/triton/lora.py's shrink and expand against kernels/reference.py: rows of several
adapters and of none (-1), ranks and widths not multiples of the blocks, fp32 and bf16 y, an
output offset into a fused projection. On the CPU through the Triton interpreter."""
from __future__ import annotations

import pytest
import torch

from tritonserve.kernels import reference
from tritonserve.kernels.triton import lora


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 12])
def test_shrink_and_expand_match_the_reference(device, dtype, rank):
    g = torch.Generator().manual_seed(rank)
    tokens, k, n, slots_n, offset = 5, 40, 24, 3, 8
    x = torch.randn(tokens, k, generator=g).to(device=device, dtype=dtype)
    a = torch.randn(slots_n, rank, k, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(slots_n, n, rank, generator=g).to(device=device, dtype=dtype)
    slots = torch.tensor([2, -1, 0, 2, 1], dtype=torch.int32, device=device)
    xa = lora.lora_shrink(x, a, slots, block_r=8, block_k=16)
    want = reference.lora_shrink(x, a, slots)
    torch.testing.assert_close(xa, want, rtol=1e-4, atol=1e-4)
    assert torch.all(xa[1] == 0)
    y = torch.randn(tokens, offset + n + 4, generator=g).to(device=device, dtype=dtype)
    expect = y.clone()
    reference.lora_expand(expect, want, b, slots, offset)
    lora.lora_expand(y, xa, b, slots, offset, block_n=16, block_r=8)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), expect.float(), rtol=tol, atol=tol * 10)
    base = torch.randn(tokens, offset + n + 4, generator=g).to(device=device, dtype=dtype)
    torch.testing.assert_close(y[1], expect[1])  # the base row: untouched by both
    assert base.shape == y.shape
