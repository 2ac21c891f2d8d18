#!/usr/bin/env bash
# Issue 65's figures: a mixture of experts scaled to this machine (`tritonserve bench
# model-shape --shape qwen3-moe-2.6b-a0.4b`: Qwen3-30B-A3B's layout, 24 layers, 64 experts top
# 8, random weights) converted by llama.cpp's own convert_hf_to_gguf.py and quantized by its
# quantizer to Q4_K_M, served by ours and by llama.cpp's server from the same file, side by
# side in the same run through `tritonserve bench serve` (OpenAI /v1/completions, streaming,
# prompts of 64 random words as text: llama_cpp.server takes no token-id prompts; EOS ignored), default sampling and greedy, at 1 stream (8 x 64
# requests x tokens) and 16 (32 x 64). The floor: the bytes a token reads (the chosen experts,
# attention, the head: bench/moe_floor.py counts them from the file) at the machine's read rate,
# measured before and after.
# llama.cpp's server sends no usage: tritonserve/bench/peer_proxy.py counts its streamed chunks.
# llama-cpp-python's server runs one request at a time (a new one would interrupt it unless
# --interrupt_requests False: then they queue); its 16-stream cell is that queue, not the C++
# llama-server's parallel slots, which llama-cpp-python does not ship.
# Needs llama-cpp-python[server] in $LLAMA_VENV (docs/peers.md) and llama.cpp's source tree in
# $LLAMA_CPP (its converter; llama-cpp-python's sdist carries one under vendor/llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repo root
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
lpy=${LLAMA_VENV:-/tmp/llama-venv}/bin/python
converter=${LLAMA_CPP:?set LLAMA_CPP to llama.cpp\'s source tree}/convert_hf_to_gguf.py
out=${OUT:-results/moe}
shape=qwen3-moe-2.6b-a0.4b
mkdir -p "$out"

model=$out/$shape
[ -f "$model/config.json" ] || $py -m tritonserve bench model-shape --shape "$shape" --out "$model"
file=$out/$shape-Q4_K_M.gguf
if [ ! -f "$file" ]; then
  [ -f "$out/$shape-bf16.gguf" ] || $py "$converter" "$model" --outtype bf16 \
    --outfile "$out/$shape-bf16.gguf" > "$out/convert.log" 2>&1
  $lpy - "$out/$shape-bf16.gguf" "$file" <<'PY'
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
params.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),
                                        ctypes.byref(params)))
PY
fi

source tritonserve/bench/cells.sh  # settle, sampling_args
bench() {  # name port concurrency prompts seed extra...
  local name=$1 port=$2 c=$3 n=$4 seed=$5; shift 5
  $py -m tritonserve.bench serve --base-url "http://127.0.0.1:$port" --endpoint completions \
    --model moe --input-len 64 --output-len 64 --num-prompts "$n" \
    --max-concurrency "$c" --seed "$seed" --result-json "$out/$name.json" "$@" \
    > "$out/$name.txt" 2>&1
  grep -E "Output token throughput|TPOT" "$out/$name.txt" | sed "s/^/$name: /"
}
wait_ready() { until curl -sf "http://127.0.0.1:$1/v1/models" > /dev/null; do sleep 2; done; }
read_rate() {
  $py -c "from tritonserve.bench.cpu_decode import read_gbps; print(round(read_gbps(), 1))"
}
pids=()
stop_all() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; pids=(); }
trap stop_all EXIT

rate=$(read_rate)
echo "read GB/s before: $rate" | tee "$out/machine.txt"
$py -m tritonserve.bench.moe_floor "$file" --read-gbps "$rate" | tee -a "$out/machine.txt"

$py -m tritonserve.server --model "$file" --port 8123 --served-model-name moe \
  > "$out/ours.log" 2>&1 &
pids+=($!)
$lpy -m llama_cpp.server --model "$file" --port 8200 --n_threads 2 --model_alias moe \
  --n_ctx 4096 --interrupt_requests False > "$out/llama.log" 2>&1 &
pids+=($!)
$py -m tritonserve.bench.peer_proxy --port 8201 --target http://127.0.0.1:8200 \
  > "$out/proxy.log" 2>&1 &
pids+=($!)
for p in 8123 8200; do wait_ready "$p"; done
names=(ours llama); ports=(8123 8201)
for i in 0 1; do bench "${names[$i]}_warmup" "${ports[$i]}" 2 2 1000 > /dev/null; done
cell=0
for spec in "1 8" "16 32"; do
  set -- $spec
  for sampling in default greedy; do
    sampling_args "$sampling" $((10 * $1))
    for k in 0 1; do
      i=$(( (k + cell) % 2 )); settle
      bench "${names[$i]}_c$1_$sampling" "${ports[$i]}" "$1" "$2" "$seed" "${extra[@]}"
    done
    cell=$((cell + 1))
  done
done
echo "read GB/s after: $(read_rate)" | tee -a "$out/machine.txt"
grep -h "decode" "$out/ours.log" | head -2
