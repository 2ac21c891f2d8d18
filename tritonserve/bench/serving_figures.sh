#!/usr/bin/env bash
# The serving table (docs/perf-log/2026-11-engine-and-serving.md): SmolLM2 through HTTP (bench serve, native
# route) at 16 and 64 concurrent streams, greedy, the server's default sampling
# (temperature 1.0) and temperature 1.0 with top_p 0.95; and the same workload through the
# offline engine (greedy and default sampling). 64 prompts of 100 random tokens, 128 output
# tokens (EOS ignored). About 15 minutes here. DTYPE=bfloat16 for bf16 (default float32).
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repo root
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
out=${OUT:-results}
dtype=${DTYPE:-float32}
mkdir -p "$out"
model=$($py -c "from tritonserve.engine.default_model import default_model_path; print(default_model_path())")
port=${PORT:-8123}
declare -A sampling=([greedy]="--temperature 0" [default]="" [top_p]="--temperature 1 --top-p 0.95")
for c in 16 64; do
  for mode in greedy default top_p; do
    # a fresh server each time: the same prompts must not hit the previous run's prefix cache
    $py -m tritonserve.server --port "$port" --max-num-seqs 64 --dtype "$dtype" > "$out/server.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    until grep -q READY "$out/server.log"; do sleep 1; done
    # shellcheck disable=SC2086
    $py -m tritonserve.bench serve --base-url "http://127.0.0.1:$port" --endpoint native --num-prompts 64 \
      --max-concurrency "$c" --input-len 100 --output-len 128 --tokenizer "$model" --seed 0 \
      ${sampling[$mode]} --result-json "$out/serve_c${c}_$mode.json" \
      | tee "$out/serve_c${c}_$mode.txt"
    kill $server; wait $server 2>/dev/null || true
  done
done
for c in 16 64; do
  $py -m tritonserve.bench throughput --skip-hf --num-prompts 64 --input-len 100 --output-len 128 \
    --max-num-seqs "$c" --dtype "$dtype" --result-json "$out/offline_c$c.json" \
    | tee "$out/offline_c$c.txt"
done
$py - "$out" <<'PY'
import json, sys
out = sys.argv[1]
print("| concurrency | sampling | HTTP output tok/s | vs greedy | offline tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | protocol errors |")
print("|---|---|---|---|---|---|---|---|")
for c in (16, 64):
    off = json.load(open(f"{out}/offline_c{c}.json"))
    offline = {"greedy": off["engine_tok_s"], "default": off["sampled"]["engine_tok_s"],
               "top_p": None}
    greedy = None
    for mode, label in (("greedy", "greedy"), ("default", "T=1 (default)"),
                        ("top_p", "T=1, top_p 0.95")):
        s = json.load(open(f"{out}/serve_c{c}_{mode}.json"))["summary"]
        tps = s["output_throughput"]
        greedy = greedy or tps
        o = offline[mode]
        print(f"| {c} | {label} | {tps:.1f} | {tps / greedy:.2f} | "
              f"{'-' if o is None else f'{o:.1f}'} | "
              f"{s['ttft_ms']['median']:.0f} / {s['ttft_ms']['p99']:.0f} | "
              f"{s['tpot_ms']['median']:.0f} / {s['tpot_ms']['p99']:.0f} | {s['protocol_errors']} |")
PY
