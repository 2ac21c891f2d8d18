"""Every kernel variant compiles to an sm_90 (H100/H200) cubin, without a GPU: catches what
the interpreter cannot (dot shape rules, dtype rules, ops the compiler rejects)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tritonserve.kernels.triton import prefill_attention


@pytest.mark.slow
def test_all_kernels_compile_for_hopper():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-m", "tritonserve.kernels.triton.compile_check", "--arch",
                           "90"], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ok  sm_90")]
    total = int(proc.stdout.strip().splitlines()[-1].split()[0])  # "N variants compiled"
    assert len(lines) == total > 30, proc.stdout
    for kernel in ("decode", "prefill", "merge splits", "store_kv_cache", "sample", "fused_moe",
                   "lora_shrink", "lora_expand", "sgmv_shrink", "sgmv_expand"):
        assert any(kernel in line for line in lines), kernel
    # every prefill autotuning config, in every dtype
    for dtype, configs in (("bf16", len(prefill_attention.tuning_space(False))), ("fp16", 1),
                           ("fp32", len(prefill_attention.tuning_space(True)))):
        assert sum(f"prefill {dtype} g4 d128 bs16" in line for line in lines) == configs
