#!/usr/bin/env bash
# Speculative decoding's figures (issue 49; docs/benchmarks.md "Speculative decoding"), one
# run: the embedded model served plainly and with `--speculative-method ngram` (its defaults),
# both up at once, each cell run on both back to back (order turning), through `tritonserve
# bench serve` (every stream validated): a copy-heavy workload at 1 stream (chat route,
# tritonserve/bench/data/copy_edit.jsonl: repeat / lightly edit a paragraph or a code block,
# 16 requests, up to 160 tokens, EOS honoured), the peer workload at 1 stream (8 x 64 tokens of
# 64-token random prompts, EOS ignored) and at 64 streams (64 x 128); greedy and default
# sampling. The acceptance rate of each cell from the speculating server's /metrics; the
# machine's read rate before and after. About 8 minutes on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repo root
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
out=${OUT:-results/spec}
mkdir -p "$out"
model=$($py -c "from tritonserve.engine.default_model import default_model_path; print(default_model_path())")
counters() { curl -sf "http://127.0.0.1:8152/metrics" | grep '^tritonserve:spec_decode' || true; }
source tritonserve/bench/machine.sh

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
$py -m tritonserve.server --port 8151 --max-num-seqs 64 > "$out/plain.log" 2>&1 & pids+=($!)
# SPEC_ARGS: other speculation flags for the speculating server (e.g. "--ngram-min 1")
read -r -a spec_args <<< "${SPEC_ARGS:-}"
$py -m tritonserve.server --port 8152 --max-num-seqs 64 --speculative-method ngram \
  "${spec_args[@]}" > "$out/spec.log" 2>&1 & pids+=($!)
until grep -q READY "$out/plain.log" && grep -q READY "$out/spec.log"; do sleep 1; done
machine | sed 's/^/before: /' | tee "$out/machine.txt"
names=(plain spec); ports=(8151 8152)
turn=0
for cell in copy words1 words64; do
  case $cell in
    copy) args=(--endpoint chat --dataset tritonserve/bench/data/copy_edit.jsonl --num-prompts 16
                --max-concurrency 1 --no-ignore-eos);;
    words1) args=(--endpoint native --num-prompts 8 --max-concurrency 1 --input-len 64
                  --output-len 64);;
    words64) args=(--endpoint native --num-prompts 64 --max-concurrency 64 --input-len 64
                   --output-len 128);;
  esac
  for mode in greedy default; do
    extra=(); [ "$mode" = greedy ] && extra=(--temperature 0)
    order=(0 1); [ $((turn % 2)) = 1 ] && order=(1 0)
    turn=$((turn + 1))
    for i in "${order[@]}"; do
      [ "$i" = 1 ] && counters > "$out/${cell}_${mode}.before"
      $py -m tritonserve.bench serve --base-url "http://127.0.0.1:${ports[$i]}" "${args[@]}" \
        --tokenizer "$model" --seed "$turn" "${extra[@]}" \
        --result-json "$out/${names[$i]}_${cell}_$mode.json" > "$out/${names[$i]}_${cell}_$mode.txt"
      [ "$i" = 1 ] && counters > "$out/${cell}_${mode}.after"
    done
  done
done
machine | sed 's/^/after: /' | tee -a "$out/machine.txt"
$py - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def counter(path, name):
    for line in open(path):
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0
print("| workload | streams | sampling | plain tok/s | ngram tok/s | ngram / plain | TPOT p50 plain / ngram (ms) | acceptance | mean accepted | protocol errors |")
print("|---|---|---|---|---|---|---|---|---|---|")
for cell, label, streams in (("copy", "copy / edit", 1), ("words1", "random words", 1),
                             ("words64", "random words", 64)):
    for mode in ("greedy", "default"):
        a = json.load(open(f"{out}/plain_{cell}_{mode}.json"))["summary"]
        b = json.load(open(f"{out}/spec_{cell}_{mode}.json"))["summary"]
        d = {n: counter(f"{out}/{cell}_{mode}.after", f"tritonserve:spec_decode_{n}_total")
             - counter(f"{out}/{cell}_{mode}.before", f"tritonserve:spec_decode_{n}_total")
             for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        rate = d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0
        mean = d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else 0
        print(f"| {label} | {streams} | {mode} | {a['output_throughput']:.1f} | "
              f"{b['output_throughput']:.1f} | {b['output_throughput'] / a['output_throughput']:.2f}x | "
              f"{a['tpot_ms']['median']:.1f} / {b['tpot_ms']['median']:.1f} | {rate:.0%} "
              f"({d['num_draft_tokens']:.0f} proposed) | {mean:.2f} | "
              f"{a['protocol_errors'] + b['protocol_errors']} |")
PY
