"""bench throughput's compute ceiling measures the engine's own matmul path."""
from __future__ import annotations

import pytest
import torch

from bench.throughput import measure_matmul_gflops
from engine.models import decoder


def test_ceiling_measures_the_engine_linear_path(monkeypatch):
    if not decoder.can_prepack(torch.empty(1)):
        pytest.skip("no oneDNN here: the engine's linear is F.linear")

    def refuse(*args, **kwargs):
        raise AssertionError("the ceiling measured F.linear, not the engine's oneDNN path")

    monkeypatch.setattr(decoder.F, "linear", refuse)
    rates = measure_matmul_gflops(size=128, repeats=2)
    assert set(rates) == {"torch_mm", "engine_linear"}
    assert all(rate > 0 for rate in rates.values())
