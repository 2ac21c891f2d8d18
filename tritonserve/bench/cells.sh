# The cells of a side-by-side run, sourced by peer_figures.sh and gguf_figures.sh: each
# (streams x sampling) cell on every server of the caller's `names` / `ports` arrays, back to
# back, the order turning by one server from cell to cell (so a pair of figures is minutes
# apart, not a whole server's run). Calls the caller's `bench NAME PORT STREAMS PROMPTS
# OUTPUT_LEN SEED EXTRA...`. Streams 1, 16, 64 with 8 x 64, 32 x 64, 64 x 128 requests x
# tokens; each run draws its own prompts (seed). Before each bench call the machine settles:
# a server whose client left (llama.cpp's interrupted streams) may still be computing, and
# the next server's cell would pay for it.
settle() {  # until the CPUs are >= 90 % idle over half a second, at most 20 s
  local a b i
  for i in $(seq 40); do
    a=($(head -1 /proc/stat)); sleep 0.5; b=($(head -1 /proc/stat))
    local idle=$(( b[4] + b[5] - a[4] - a[5] )) total=0 k
    for k in 1 2 3 4 5 6 7 8; do total=$(( total + b[k] - a[k] )); done
    [ "$total" -gt 0 ] && [ $(( 100 * idle / total )) -ge 90 ] && return 0
  done
}
sampling_args() {  # SAMPLING BASE_SEED: sets `extra` (the client's sampling flags) and `seed`
  extra=(); seed=$2
  if [ "$1" = greedy ]; then extra=(--temperature 0); seed=$(( $2 + 1 )); fi
}
run_cells() {
  local cell=0 count=${#names[@]} spec sampling seed k i
  local -a extra
  for spec in "1 8 64" "16 32 64" "64 64 128"; do
    set -- $spec
    for sampling in default greedy; do
      sampling_args "$sampling" $((10 * $1))
      for k in $(seq 0 $((count - 1))); do
        i=$(( (k + cell) % count ))
        settle
        bench "${names[$i]}_c$1_$sampling" "${ports[$i]}" "$1" "$2" "$3" "$seed" "${extra[@]}"
      done
      cell=$((cell + 1))
    done
  done
}
run_one_stream_rounds() {  # ROUNDS: rounds 2..ROUNDS of the 1-stream cells, named NAME_c1_SAMPLING_rK
  local round sampling seed k i
  local -a extra
  for round in $(seq 2 "$1"); do
    for sampling in default greedy; do
      sampling_args "$sampling" $((1000 * round))
      for k in "${!names[@]}"; do
        i=$(( (k + round) % ${#names[@]} ))
        settle
        bench "${names[$i]}_c1_${sampling}_r$round" "${ports[$i]}" 1 8 64 "$seed" "${extra[@]}"
      done
    done
  done
}
