"""tritonserve/bench/gpu_check.sh --dry-run: the GPU machine's one script rehearsed on the CPU,
so the first (15-minute) GPU session does not find a broken script."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run_writes_every_section(tmp_path):
    """As the README's set-up leaves it: no PYTHON given, the script finds .venv's python (it
    once ran `python3` from PATH, which has no torch). Outside a repo venv (a temporary one
    of scripts/check_latest.sh), PYTHON names this interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["OUT"] = str(tmp_path)
    if not (ROOT / ".venv" / "bin" / "python").exists():
        env["PYTHON"] = sys.executable
    proc = subprocess.run(["bash", "tritonserve/bench/gpu_check.sh", "--dry-run"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "gpu_check.md").read_text()
    for section in ("## Kernel tests", "## Kernel microbenchmarks", "## Engine"):
        assert section in report
    kernels = json.loads((tmp_path / "kernels.json").read_text())
    measured = {(r["kernel"], r["impl"]) for r in kernels["rows"]}
    for kernel in ("decode_attention", "prefill_attention", "store_kv_cache"):
        assert (kernel, "triton") in measured, kernel  # the interpreted Triton path ran
    assert kernels["ceilings"]["copy_GB/s"] > 0 and kernels["ceilings"]["matmul_TFLOP/s"] > 0
    engine = json.loads((tmp_path / "engine.json").read_text())
    agreement = engine["agreement"]
    assert agreement["identical"] == agreement["sequences"] == 2  # fp32: no ties to break
    for mode, rows in (("eager", engine["engine"]["eager"]), ("static", engine["engine"]["graphs"])):
        assert [(r["batch"], r["mode"]) for r in rows] == [(1, mode), (4, mode)]
        assert all(r["decode_tok_s"] > 0 and r["kv_cache_blocks"] > 0 for r in rows)
    assert engine["transformers"][0]["tokens"] == 4 * 8  # every request ran to max_new_tokens
