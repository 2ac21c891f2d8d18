"""tritonserve bench quant-accuracy's measures on the tiny model: a form against itself is
KL 0, full top-1 agreement and the same perplexity; int4 against the dense weights moves the
distributions a little, and perplexity is exp of the mean negative log-likelihood."""
from __future__ import annotations

import math

import pytest
import torch

from tritonserve.bench import quant_accuracy
from tritonserve.kernels import cpu


@pytest.mark.skipif(cpu.op("packed_linear_quant") is None, reason="no C++ toolchain")
def test_the_measures(tiny_model):
    windows = [[(7 * i + 3) % 300 for i in range(40)], [(5 * i + 1) % 300 for i in range(40)]]
    dense = quant_accuracy.window_logprobs(tiny_model, "none", "float32", windows)
    assert [d.shape[0] for d in dense] == [40, 40]
    same = quant_accuracy.compare(dense, dense, windows)
    assert same["kl"] == 0.0 and same["top1"] == 1.0 and same["ppl"] == same["ppl_ref"]
    nll = -sum(float(d[:-1].gather(1, torch.tensor(w[1:])[:, None]).sum())
               for d, w in zip(dense, windows))
    assert same["ppl"] == pytest.approx(math.exp(nll / 78)) and same["tokens"] == 78
    q4 = quant_accuracy.window_logprobs(tiny_model, "int4", "float32", windows)
    moved = quant_accuracy.compare(dense, q4, windows)
    assert 0.0 < moved["kl"] < 1.0 and 0.25 < moved["top1"] <= 1.0  # random weights: far apart
