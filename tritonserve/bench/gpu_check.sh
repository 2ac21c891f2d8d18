#!/usr/bin/env bash
# One prepared script for a CUDA machine, under 10 minutes (timeouts 200 + 120 + 90 + 180 s): the
# kernel tests on CUDA, the kernel microbenchmarks (shares of this run's measured copy
# bandwidth and matmul rate; the w4a16 / w8a16 matmul at batch 1 and 64 beside the dense bf16
# one; the fused MoE over Qwen3-30B-A3B's experts at batch 1 and 64, bf16 and w4a16), then the engine end to end on a Llama-3-8B-shaped dummy model in bf16 (Triton vs torch
# greedy agreement, decode tok/s at batch 1/64/256 eager and with CUDA graphs captured per
# bucket, transformers generate_batch). Writes the report to ${OUT:-results}/gpu_check.md.
#
#   bash tritonserve/bench/gpu_check.sh             on a GPU machine (no install: torch, triton, pytest
#                                       and transformers from the image; nothing is fetched)
#   bash tritonserve/bench/gpu_check.sh --dry-run   the same sections on the CPU: tiny shapes, the Triton
#                                       kernels interpreted (CI runs this)
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repo root
out=${OUT:-results}
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ "${1:-}" = "--dry-run" ]; then
  export TRITON_INTERPRET=1
  where="dry run on the CPU (interpreted kernels, tiny shapes)"
  tests=(tests/test_kernels_attention.py -k "prefill_tile_shapes or splits or dense")
  engine_tests=()
  kernel_args=(--batch 2 --context 64 --heads 4 --kv-heads 2 --head-dim 32 --dtype float32
               --sample-batch 4 --vocab 512)
  engine_args=(--shape tiny --dtype float32 --batches 1,4 --hf-batches 4 --input-len 16
               --output-len 8 --agree-prompts 2 --agree-tokens 8)
else
  export TRITON_INTERPRET=0
  where=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)
  tests=(tests/test_kernels_attention.py tests/test_kernels_sampling.py
         tests/test_kernels_fused.py tests/test_kernels_moe.py tests/test_kernels_lora.py)
  # Triton's compiles are CPU work: one process took ~310 s for these and the engine tests on
  # an H200 machine (test_mixed_rows_in_one_batch alone 67 s); pytest-xdist spreads the kernel
  # tests over the cores. The engine tests stay in one process: each engine takes 0.9 of the
  # GPU's memory for its KV cache. Not enforce_eager: it parses the server's flags, and the
  # CUDA image has no pydantic.
  "$py" -c "import xdist" 2> /dev/null && tests+=(-n 8)
  engine_tests=(tests/test_quant_triton.py tests/test_decode_graphs.py
                -k "not compiled and not enforce_eager")
  kernel_args=()
  engine_args=(--shape llama3-8b --dtype bfloat16 --batches 1,64,256 --hf-batches 64
               --input-len 128 --output-len 64)
fi
echo "== kernel tests ($where)"
{ timeout 200 "$py" -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1
  [ ${#engine_tests[@]} -eq 0 ] \
    || timeout 120 "$py" -m pytest -q -p no:cacheprovider "${engine_tests[@]}" 2>&1
} | tee "$out/kernel_tests.log" | grep "passed\|failed\|error"
echo "== tensor parallel"
if [ "${1:-}" != "--dry-run" ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 180 "$py" -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py \
    -k two_ranks 2>&1 | tee "$out/tp.log" | tail -3
else
  echo "tensor parallel tp=2: skipped: one GPU" | tee "$out/tp.log"
fi
echo "== kernel microbenchmarks"
timeout 90 "$py" -m tritonserve.bench kernels "${kernel_args[@]}" --json "$out/kernels.json" 2>&1 \
  | tee "$out/kernels.txt"
echo "== engine"
timeout 180 "$py" -m tritonserve.bench engine-check "${engine_args[@]}" --json "$out/engine.json" 2>&1 \
  | tee "$out/engine.txt"
{
  echo "# GPU check: $where"
  echo
  echo "## Kernel tests"
  echo '```'
  grep "passed\|failed\|error" "$out/kernel_tests.log"
  echo '```'
  echo "## Tensor parallel (tp=2, NCCL)"
  echo '```'
  tail -3 "$out/tp.log"
  echo '```'
  echo "## Kernel microbenchmarks"
  echo '```'
  cat "$out/kernels.txt"
  echo '```'
  echo "## Engine"
  grep -v '^\(INFO\|WARNING\)' "$out/engine.txt" | tail -12
} > "$out/gpu_check.md"
cat "$out/gpu_check.md"
grep -q "passed" "$out/kernel_tests.log" && ! grep -q "failed\|error" "$out/kernel_tests.log" \
  && grep -q "decode_attention" "$out/kernels.txt" && grep -q "^| 1 |" "$out/engine.txt"
