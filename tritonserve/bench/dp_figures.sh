#!/usr/bin/env bash
# Data parallelism's figures (issue 47; docs/benchmarks.md "Data parallelism"), one run:
# 1. the embedded model served by one engine on every core (2 threads here) and by
#    --data-parallel-size 2 (two engines of one core each), both up at once, each cell run on
#    both back to back (order turning), through `tritonserve bench serve` (native route,
#    streaming, every stream validated): 1, 16 and 64 streams (8 x 64, 32 x 64, 64 x 128
#    requests x output tokens, 64-token random prompts, EOS ignored), greedy and default
#    sampling. The machine's read rate before and after.
# 2. a shared-prefix workload (16 system prompts of 512 tokens, each request one of them plus a
#    32-token question, 16 output tokens, 128 requests, 16 streams) on two fresh DP=2 servers,
#    --data-parallel-routing prefix and random: the prefix-cache hit rate from each server's
#    /metrics, and the throughput.
# About 8 minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repo root
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
out=${OUT:-results/dp}
mkdir -p "$out"
model=$($py -c "from tritonserve.engine.default_model import default_model_path; print(default_model_path())")
serve() {  # name port extra...
  local name=$1 port=$2; shift 2
  $py -m tritonserve.server --port "$port" --max-num-seqs 64 "$@" > "$out/$name.log" 2>&1 &
  pids+=($!)
}
wait_ready() { until grep -q READY "$out/$1.log"; do sleep 1; done; }
bench() {  # name port concurrency prompts output_len seed extra...
  local name=$1 port=$2 c=$3 n=$4 len=$5 seed=$6; shift 6
  $py -m tritonserve.bench serve --base-url "http://127.0.0.1:$port" --endpoint native \
    --num-prompts "$n" --max-concurrency "$c" --input-len 64 --output-len "$len" \
    --tokenizer "$model" --seed "$seed" --result-json "$out/$name.json" "$@" > "$out/$name.txt"
}
source tritonserve/bench/machine.sh

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
serve one 8131
serve dp2 8132 --data-parallel-size 2
wait_ready one; wait_ready dp2
machine | sed 's/^/before: /' | tee "$out/machine.txt"
names=(one dp2); ports=(8131 8132)
for i in 0 1; do bench "${names[$i]}_warmup" "${ports[$i]}" 4 8 16 1000; done
turn=0
for cell in "1 8 64" "16 32 64" "64 64 128"; do
  read -r c n len <<< "$cell"
  for mode in greedy default; do
    extra=(); [ "$mode" = greedy ] && extra=(--temperature 0)
    order=(0 1); [ $((turn % 2)) = 1 ] && order=(1 0)
    turn=$((turn + 1))
    for i in "${order[@]}"; do
      bench "${names[$i]}_c${c}_$mode" "${ports[$i]}" "$c" "$n" "$len" "$((c + turn))" "${extra[@]}"
    done
  done
done
machine | sed 's/^/after: /' | tee -a "$out/machine.txt"
kill "${pids[@]}"; wait "${pids[@]}" 2>/dev/null || true
pids=()
serve prefix 8133 --data-parallel-size 2 --data-parallel-routing prefix
serve random 8134 --data-parallel-size 2 --data-parallel-routing random
wait_ready prefix; wait_ready random
for name in prefix random; do
  port=$([ $name = prefix ] && echo 8133 || echo 8134)
  bench "shared_$name" "$port" 16 128 16 5 --dataset shared-prefix --num-prefixes 16 \
    --prefix-len 512 --input-len 32
  curl -sf "http://127.0.0.1:$port/metrics" > "$out/shared_$name.metrics"
done
$py - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def summary(name):
    return json.load(open(f"{out}/{name}.json"))["summary"]
print("| streams | sampling | one engine x 2 threads tok/s | DP=2 x 1 thread tok/s | DP / one | "
      "TTFT p50 one / DP (ms) | TPOT p50 one / DP (ms) | protocol errors |")
print("|---|---|---|---|---|---|---|---|")
for c in (1, 16, 64):
    for mode in ("greedy", "default"):
        a, b = summary(f"one_c{c}_{mode}"), summary(f"dp2_c{c}_{mode}")
        print(f"| {c} | {mode} | {a['output_throughput']:.1f} | {b['output_throughput']:.1f} | "
              f"{b['output_throughput'] / a['output_throughput']:.2f}x | "
              f"{a['ttft_ms']['median']:.0f} / {b['ttft_ms']['median']:.0f} | "
              f"{a['tpot_ms']['median']:.1f} / {b['tpot_ms']['median']:.1f} | "
              f"{a['protocol_errors'] + b['protocol_errors']} |")
def counter(name, metric):
    total = 0.0
    for line in open(f"{out}/shared_{name}.metrics"):
        if line.startswith(metric + " ") or line.startswith(metric + "{"):
            total += float(line.split()[-1])
    return total
print()
print("| routing | prefix-cache hit rate | hits per engine | output tok/s | TTFT p50 (ms) | "
      "protocol errors |")
print("|---|---|---|---|---|---|")
for name in ("prefix", "random"):
    s = summary(f"shared_{name}")
    hits = counter(name, "tritonserve:prefix_cache_hits_total")
    queries = counter(name, "tritonserve:prefix_cache_queries_total")
    per = [counter(name, f'tritonserve:engine_prefix_cache_hits_total{{engine="{i}"}}')
           for i in (0, 1)]
    print(f"| {name} | {hits / queries:.1%} | {per[0]:.0f} / {per[1]:.0f} | "
          f"{s['output_throughput']:.1f} | {s['ttft_ms']['median']:.0f} | "
          f"{s['protocol_errors']} |")
PY
