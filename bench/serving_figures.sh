#!/usr/bin/env bash
# The serving table of docs/benchmarks.md: SmolLM2 through HTTP (bench serve, native
# route) at 16 and 64 concurrent streams, and the same workload through the offline engine.
# 64 prompts of 100 random tokens, 128 output tokens (EOS ignored). About 6 minutes here.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
out=${OUT:-results}
mkdir -p "$out"
model=$($py -c "from engine.default_model import default_model_path; print(default_model_path())")
port=${PORT:-8123}
for c in 16 64; do
  # a fresh server each time: the same prompts must not hit the previous run's prefix cache
  $py -m server --port "$port" --max-num-seqs 64 > "$out/server_c$c.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  until grep -q READY "$out/server_c$c.log"; do sleep 1; done
  $py -m bench serve --base-url "http://127.0.0.1:$port" --endpoint native --num-prompts 64 \
    --max-concurrency "$c" --input-len 100 --output-len 128 --tokenizer "$model" --seed 0 \
    --result-json "$out/serve_c$c.json" | tee "$out/serve_c$c.txt"
  kill $server; wait $server 2>/dev/null || true
done
for c in 16 64; do
  $py -m bench throughput --skip-hf --num-prompts 64 --input-len 100 --output-len 128 \
    --max-num-seqs "$c" --result-json "$out/offline_c$c.json" | tee "$out/offline_c$c.txt"
done
$py - "$out" <<'PY'
import json, sys
out = sys.argv[1]
print("| concurrency | HTTP output tok/s | offline tok/s | HTTP / offline | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | protocol errors |")
print("|---|---|---|---|---|---|---|")
for c in (16, 64):
    s = json.load(open(f"{out}/serve_c{c}.json"))["summary"]
    o = json.load(open(f"{out}/offline_c{c}.json"))["engine_tok_s"]
    print(f"| {c} | {s['output_throughput']:.1f} | {o:.1f} | {s['output_throughput'] / o:.2f} | "
          f"{s['ttft_ms']['median']:.0f} / {s['ttft_ms']['p99']:.0f} | "
          f"{s['tpot_ms']['median']:.0f} / {s['tpot_ms']['p99']:.0f} | {s['protocol_errors']} |")
PY
