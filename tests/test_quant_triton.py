"""The Triton w4a16 / w8a16 matmul (kernels/triton/quant_matmul.py) under the interpreter
against the dequantized reference (quant_layout.linear): u4, s8 and s8h, a partial last panel,
bias, one row and a batch wider than a row tile. bf16 inputs compute in fp32 here (the
interpreter has no bf16 arithmetic); compiled for sm_90 by compile_check."""
from __future__ import annotations

import pytest
import torch

from tritonserve.kernels import quant_layout
from tritonserve.kernels.triton.quant_matmul import quant_linear


@pytest.mark.parametrize("kind", ["u4", "s8", "s8h"])
@pytest.mark.parametrize("rows,n,bias", [(1, 40, False), (3, 72, True), (17, 16, False)])
def test_the_triton_matmul_is_the_dequantized_reference(kind, rows, n, bias, device):
    torch.manual_seed(rows + n)
    k = 64
    weight = quant_layout.quantize(torch.randn(n, k), kind).to(device)
    x = torch.randn(rows, k, device=device)
    b = torch.randn(n, device=device) if bias else None
    got = quant_linear(x, weight, n, b)
    want = quant_layout.linear(x.cpu(), weight.cpu(), n, None if b is None else b.cpu())
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_bf16_inputs_and_refusals(device):
    torch.manual_seed(0)
    weight = quant_layout.quantize(torch.randn(32, 96), "u4").to(device)
    x = torch.randn(2, 96, device=device).bfloat16()
    got = quant_linear(x, weight, 32)
    assert got.dtype == torch.bfloat16
    want = quant_layout.linear(x.float().cpu(), weight.cpu(), 32)
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="does not match"):
        quant_linear(torch.randn(2, 64, device=device), weight, 32)
    with pytest.raises(ValueError, match="not a packed quantized weight"):
        quant_linear(x, torch.zeros(32, 96, device=device), 32)


def test_the_engine_through_the_triton_matmul(monkeypatch, device):
    """The engine end to end with every quantized projection through the Triton kernel, on
    int4 weights in fp32: interpreted on the CPU (greedy tokens = the C++ tiles'), on CUDA the
    plan's own path (= the dequantized reference's tokens)."""
    from tests.test_decode_layers import SHAPE
    from tests.tiny_models import write_tiny_model
    import tempfile
    from pathlib import Path

    from tritonserve.engine import LLM, SamplingParams
    from tritonserve.engine.models import ops

    folder = write_tiny_model(Path(tempfile.mkdtemp()) / "m", seed=2, num_hidden_layers=1,
                              **SHAPE)
    llm = LLM(str(folder), dtype="float32", quantization="int4", decode_mode="eager",
              max_num_seqs=2, device=device)
    prompts = [[5, 17, 42, 9], [3, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    calls = []
    if device == "cuda":  # the plan's path is the kernel; the reference replaces it after
        forward_cuda = ops.QuantLinear.forward_cuda

        def counted(self, x, weight, n, bias):
            calls.append(n)
            return forward_cuda(self, x, weight, n, bias)

        monkeypatch.setattr(ops.QuantLinear, "forward_cuda", counted)
        triton_tokens = [o.token_ids for o in llm.generate(prompts, params)]
        monkeypatch.setattr(ops.QuantLinear, "__call__", ops.QuantLinear.forward_native)
        assert [o.token_ids for o in llm.generate(prompts, params)] == triton_tokens
        assert calls  # the kernel ran
        return
    cpp = [o.token_ids for o in llm.generate(prompts, params)]

    def through_triton(self, x, weight, n, bias):
        calls.append(n)
        return self.forward_cuda(x, weight, n, bias)

    monkeypatch.setattr(ops.QuantLinear, "__call__", through_triton)
    assert [o.token_ids for o in llm.generate(prompts, params)] == cpp
    assert calls  # the kernel ran
