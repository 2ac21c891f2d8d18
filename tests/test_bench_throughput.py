"""bench throughput's compute ceiling and bench profile."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bench.throughput import measure_matmul_gflops
from engine.models import linear


def test_ceiling_measures_the_engine_linear_path(monkeypatch):
    if not linear.can_prepack(torch.empty(1)):
        pytest.skip("no oneDNN here: the engine's linear is F.linear")

    def refuse(*args, **kwargs):
        raise AssertionError("the ceiling measured F.linear, not the engine's oneDNN path")

    monkeypatch.setattr(linear.F, "linear", refuse)
    rates = measure_matmul_gflops(size=128, repeats=2)
    assert set(rates) == {"torch_mm", "engine_linear"}
    assert all(rate > 0 for rate in rates.values())


def test_bench_profile_reports_prefill_decode_and_ops(tiny_model):
    proc = subprocess.run([sys.executable, "-m", "bench", "profile", "--model", tiny_model,
                           "--num-prompts", "4", "--input-range", "5:20", "--steps", "3",
                           "--profile-steps", "2", "--rows", "5", "--decode-mode", "eager"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    prefill = next(line for line in lines if line.startswith("prefill:"))
    tokens = int(prefill.split()[1])
    assert 4 * 5 <= tokens <= 4 * 20
    assert any(line.startswith("decode:") and "ms per step at batch 4" in line for line in lines)
    assert "Self CPU" in proc.stdout  # the per-op table, its rows named by op namespace
    assert any(ns in proc.stdout for ns in ("aten::", "mkldnn::", "tritonserve::"))
