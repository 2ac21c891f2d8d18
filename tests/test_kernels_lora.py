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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_segmented_form_matches_the_reference(device, dtype):
    """SGMV: runs of rows sharing an adapter, cut into 16-row tiles (a run of 21 rows: a full
    tile and a partial one), equal the per-row reference; rows no tile covers stay as they
    were (zeros from the shrink, untouched by the expand)."""
    g = torch.Generator().manual_seed(7)
    rank, k, n, offset = 12, 40, 24, 8
    runs = [(0, 21, 1), (21, 3, 0), (26, 1, 2)]  # rows 24, 25: the base
    tokens = 27
    slots = torch.full((tokens,), -1, dtype=torch.int32)
    for first, count, slot in runs:
        slots[first:first + count] = slot
    x = torch.randn(tokens, k, generator=g).to(device=device, dtype=dtype)
    a = torch.randn(3, rank, k, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(3, n, rank, generator=g).to(device=device, dtype=dtype)
    tiles = lora.sgmv_tiles(runs, device)
    assert tiles.tolist() == [[0, 16, 1], [16, 5, 1], [21, 3, 0], [26, 1, 2]]
    xa = lora.sgmv_shrink(x, a, tiles)
    want = reference.lora_shrink(x, a, slots.to(device))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(xa, want, rtol=tol, atol=tol)
    assert torch.all(xa[24:26] == 0)
    y = torch.randn(tokens, offset + n + 4, generator=g).to(device=device, dtype=dtype)
    expect = y.clone()
    reference.lora_expand(expect, want, b, slots.to(device), offset)
    before = y.clone()
    lora.sgmv_expand(y, xa, b, tiles, offset)
    torch.testing.assert_close(y.float(), expect.float(), rtol=tol, atol=tol * 10)
    assert torch.equal(y[24:26], before[24:26]) and not torch.equal(y[:24], before[:24])
