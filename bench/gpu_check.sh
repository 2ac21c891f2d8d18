#!/usr/bin/env bash
# One prepared script for a CUDA machine: the kernel tests on CUDA, then the kernel
# microbenchmarks; writes a short table to ${OUT:-results}/gpu_check.md. Under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results}
mkdir -p "$out"
# No install: a GPU image with torch, triton and pytest is enough (nothing is fetched there).
export PYTHONPATH=$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
timeout 300 python3 -m pytest -q tests/test_kernels_attention.py tests/test_kernels_sampling.py \
  2>&1 | tee "$out/kernel_tests.log" | tail -5
timeout 150 python3 -m bench kernels --peak-gbps 4300 --json "$out/kernels.json" \
  2>&1 | tee "$out/kernels.txt"
{
  echo "# GPU check ($(head -2 "$out/gpu.txt" | tail -1))"
  echo
  echo '```'
  tail -3 "$out/kernel_tests.log"
  cat "$out/kernels.txt"
  echo '```'
} > "$out/gpu_check.md"
cat "$out/gpu_check.md"
