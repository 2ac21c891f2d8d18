"""bench throughput's compute ceiling and runs, and bench profile."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import torch

from tritonserve.bench.throughput import measure_matmul_gflops
from tritonserve.engine.models import linear, ops


def test_ceiling_measures_the_engine_linear_path(monkeypatch):
    if not linear.has_form("onednn", torch.float32):
        pytest.skip("no oneDNN here: the engine's linear is F.linear")

    def refuse(*args, **kwargs):
        raise AssertionError("the ceiling measured F.linear, not the engine's oneDNN path")

    monkeypatch.setattr(ops.F, "linear", refuse)
    rates = measure_matmul_gflops(size=128, repeats=2)
    assert set(rates) == {"torch_mm", "engine_linear"}
    assert all(rate > 0 for rate in rates.values())


def test_bench_profile_reports_prefill_decode_and_ops(tiny_model):
    proc = subprocess.run([sys.executable, "-m", "tritonserve.bench", "profile", "--model",
                           tiny_model, "--num-prompts", "4", "--input-range", "5:20", "--steps", "3",
                           "--profile-steps", "2", "--rows", "5", "--decode-mode", "eager"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    prefill = next(line for line in lines if line.startswith("prefill:"))
    tokens = int(prefill.split()[1])
    assert 4 * 5 <= tokens <= 4 * 20
    assert any(line.startswith("decode:") and "ms per step at batch 4" in line for line in lines)
    # the server's default dtype (auto: the tiny model is float32), named with the plan
    assert any(line.startswith("dispatched ops per step") and "(float32; decode eager (asked)"
               in line for line in lines)
    assert "Self CPU" in proc.stdout  # the per-op table, its rows named by op namespace
    assert any(ns in proc.stdout for ns in ("aten::", "mkldnn::", "tritonserve::"))


@pytest.mark.slow
def test_bench_profile_compares_direct_graph_calls_with_dynamo(tiny_model):
    """--ab-direct: blocks of compiled steps with the direct graph calls on and off, both
    sides timed; on an eager decode it says there is nothing to compare."""
    base = [sys.executable, "-m", "tritonserve.bench", "profile", "--model", tiny_model,
            "--num-prompts", "3", "--input-range", "5:20", "--steps", "2", "--profile-steps", "1", "--rows", "3",
            "--ab-direct", "2"]
    proc = subprocess.run(base + ["--decode-mode", "compile"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("direct calls"))
    figures = [float(word) for word in line.replace(",", " ").split() if word[0].isdigit()]
    assert len(figures) == 4 and all(ms > 0 for ms in figures[2:]), line  # rounds, N, 2 sides
    eager = subprocess.run(base + ["--decode-mode", "eager"], capture_output=True, text=True,
                           timeout=120)
    assert eager.returncode == 1 and "nothing to compare" in eager.stdout


@pytest.mark.slow
def test_bench_throughput_runs_share_no_prompts_and_use_the_runs_dtype(tiny_model, tmp_path):
    """The sampled run gets prompts of its own (it used to find the greedy run's in the prefix
    cache and read 1.21x faster for it), and the ceiling is measured in the engine's dtype."""
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "tritonserve.bench", "throughput", "--model",
                           tiny_model, "--num-prompts", "4", "--input-len", "40", "--output-len", "4",
                           "--dtype", "bfloat16", "--skip-hf", "--result-json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["prefix_hit_tokens"] == {"greedy": 0, "sampled": 0}
    assert result["ceiling_dtype"] == "bfloat16"
    assert "bfloat16 2048^3 matmul" in proc.stdout


@pytest.mark.slow
def test_ab_trees_alternates_two_checkouts_and_tabulates_the_ratio():
    """`bench ab-trees` against this same checkout: both sides run, in turn, and the table
    pairs like with like: each side's cell is the median of that side's rounds, and the
    ratio is after over before. Structure only: the two sides' times are whatever the
    machine gave (a busy one read 20x once), so no bound on the ratio's size."""
    proc = subprocess.run([sys.executable, "-m", "tritonserve.bench", "ab-trees", "--other", ".",
                           "--batches", "1", "--rounds", "2", "--blocks", "2",
                           "--block-steps", "3"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    sides = [line.split(":")[0] for line in lines if line.startswith("round")]
    assert sides == ["round 1 batch 1 before", "round 1 batch 1 after",
                     "round 2 batch 1 after", "round 2 batch 1 before"]
    best = {side: [] for side in ("before", "after")}
    for line in lines:
        if line.startswith("round"):
            side = line.split(":")[0].split()[-1]
            best[side].append(float(line.split("best block ")[1].split(" ms")[0]))
    row = next(line for line in lines if line.startswith("| 1 |"))
    cells = [cell.strip() for cell in row.split("|")[2:5]]
    before_best, after_best = (float(cell.split("/")[0]) for cell in cells[:2])
    assert before_best == pytest.approx(statistics.median(best["before"]), abs=0.006)
    assert after_best == pytest.approx(statistics.median(best["after"]), abs=0.006)
    ratio = float(cells[2].split("/")[0])
    assert ratio == pytest.approx(after_best / before_best, rel=0.05)


def test_bench_bound_puts_each_round_beside_its_read_rate(tiny_model):
    """bench bound: the bytes a step streams (the tiny model's projections and its lm_head),
    then a line a round whose floor is those bytes over that round's read rate."""
    from tritonserve.bench.bound import streamed_bytes
    from tritonserve.engine import LLM
    proc = subprocess.run([sys.executable, "-m", "tritonserve.bench", "bound", "--model",
                           tiny_model, "--rounds", "2", "--steps", "3", "--input-len", "5"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    model = LLM(tiny_model, max_num_seqs=1).engine.runner.model
    streamed, per = streamed_bytes(model)
    assert len(per) == 4 and sum(per) < streamed
    assert lines[0].startswith(f"a step streams {streamed / 1e6:.1f} MB")
    rounds = [line for line in lines if line.startswith("round ")]
    assert len(rounds) == 2
    for line in rounds:
        read = float(line.split("read ")[1].split(" GB/s")[0])
        step = float(line.split("step ")[1].split(" ms")[0])
        floor = float(line.split("floor ")[1].split(" ms")[0])
        assert read > 0 and step > 0
        assert floor == pytest.approx(streamed / (read * 1e9) * 1e3, abs=6e-4)
        # the minute's placement beside its read rate, where the C++ probe runs (2+ threads)
        from tritonserve.bench.cpu_decode import core_to_core_ns
        if core_to_core_ns() is not None:
            assert float(line.split("core to core ")[1].split(" ns")[0]) > 0
