"""torch.compile traces the model's whole decode forward as one graph (fullgraph): the
attention goes through the tritonserve ops (fake implementations), the torch store is a
traced scatter, the fused norm/activation fall back to plain torch, and `linear` hands the
GEMM to Inductor. The engine's compiled decode mode is tested in test_decode_graphs.py."""
from __future__ import annotations

import pytest
import torch

from tritonserve.bench.compile_probe import decode_batch
from tritonserve.engine.attention import CpuAttention
from tritonserve.engine.models import ForwardContext, ModelArch
from tritonserve.engine.models.loader import build_model
from tritonserve.kernels import cpu


@pytest.mark.slow
@pytest.mark.skipif(cpu.op("paged_decode_attention") is None, reason="no C++ toolchain")
def test_decode_forward_compiles_as_one_graph_and_matches_eager(tiny_model):
    arch = ModelArch.from_folder(tiny_model)
    model = build_model(arch, tiny_model, torch.float32, torch.device("cpu"), 64)
    context, block_size, batch = 37, 16, 3
    shape = (batch * 3, block_size, arch.num_kv_heads, arch.head_dim)
    gen = torch.Generator().manual_seed(0)
    caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
              for _ in range(arch.num_layers)]
    ids, positions, meta = decode_batch(batch, context, block_size, arch.vocab_size)
    ctx = ForwardContext(meta, caches, CpuAttention())

    def step(ids, positions):
        return model.compute_logits(model(ids, positions, ctx))

    with torch.no_grad():
        eager = step(ids, positions)
        compiled = torch.compile(step, fullgraph=True, dynamic=False)(ids, positions)
    assert compiled.shape == (batch, arch.vocab_size)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
