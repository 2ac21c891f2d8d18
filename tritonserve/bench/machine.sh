# Sourced by the *_figures.sh scripts: machine() prints this run's read rate as `tritonserve
# bench cpu-linear` measures it (best of 5), the embedded GGUF's 1-stream floor (the file's
# 96.4 MB read once a token) and the core-to-core latency (bench/cpu_decode.py: which of a
# VM's placements the minute ran on). Needs $py.
machine() {
$py -c "
import json
from tritonserve.bench.cpu_decode import core_to_core_ns, read_gbps
from tritonserve.bench.gguf_table import FILE_MB
read, ns = read_gbps(), core_to_core_ns()
print(json.dumps({'read_GB/s': round(read, 1),
                  'floor_1_stream_tok/s': round(read * 1e3 / FILE_MB, 1),
                  'core_to_core_ns': None if ns is None else round(ns, 1)}))"
}
