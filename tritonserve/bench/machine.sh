# Sourced by the *_figures.sh scripts: machine() prints this run's read rate as `tritonserve
# bench cpu-linear` measures it (best of 5) and the embedded GGUF's 1-stream floor (the file's
# 96.4 MB read once a token). Needs $py.
machine() {
$py -c "
import json
from tritonserve.bench.cpu_decode import read_gbps
read = read_gbps()
print(json.dumps({'read_GB/s': round(read, 1), 'floor_1_stream_tok/s': round(read / 0.0964, 1)}))"
}
