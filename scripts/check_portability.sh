#!/usr/bin/env bash
# The CPU library beyond this machine's compiler and CPU (CI covers c++ -march=native and
# -march=x86-64-v3 on this CPU: tests/test_cpu_build.py):
#   1. built with each compiler given (default: g++-11, the oldest supported GCC, and clang++;
#      Debian: apt-get install g++-11 clang libomp-dev), each into a cache folder of its own,
#      with the C++ op tests run against each build;
#   2. run as an AVX2 CPU with no AVX-512 (qemu-user, `-cpu Haswell-v4`; apt-get install
#      qemu-user): the loader must pick the x86-64-v3 library, never the AVX-512 one (that was
#      SIGILL, exit 132), and its ops must match the torch reference there.
#   bash scripts/check_portability.sh [COMPILER ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh > /dev/null
compilers=("$@")
[ ${#compilers[@]} -gt 0 ] || compilers=(g++-11 clang++)
status=0
for cxx in "${compilers[@]}"; do
  if ! command -v "$cxx" > /dev/null; then echo "== $cxx: not installed, skipped"; continue; fi
  cache=$(mktemp -d)
  echo "== $cxx ($("$cxx" --version | head -1))"
  if CXX=$cxx TRITONSERVE_CACHE=$cache .venv/bin/tritonserve build-ops | grep -q "ISA"; then
    CXX=$cxx TRITONSERVE_CACHE=$cache .venv/bin/python -m pytest -q -p no:cacheprovider \
      tests/test_cpu_ops.py tests/test_cpu_panels_bf16.py tests/test_decode_layers.py \
      | tail -1 || status=1
  else
    echo "build failed:"; tail -20 "$cache"/cpu_ops/*/build-failed.txt; status=1
  fi
  rm -rf "$cache"
done
if command -v qemu-x86_64 > /dev/null; then
  echo "== qemu-x86_64 -cpu Haswell-v4 (AVX2, no AVX-512; the shared cache holds the native build)"
  qemu-x86_64 -cpu Haswell-v4 .venv/bin/python - <<'PY' 2>&1 | grep -v "TCG doesn't" || status=1
import logging, sys, torch
logging.basicConfig(level=logging.INFO, format="%(message)s")
from tritonserve.kernels import cpu, reference
from tests.test_kernels_attention import make_cache, scattered_tables
assert cpu.load() and cpu.isa_levels() == (), "expected the portable library"
k, v = make_cache(12, 16, 2, 64, torch.float32, "cpu", 5)
tables = scattered_tables([30, 70], 16, 12, 5)
lens = torch.tensor([30, 70], dtype=torch.int32)
q = torch.randn(2, 4, 64)
got = cpu.op("paged_decode_attention")(q, k, v, tables, lens, 0.125)
want = reference.paged_decode_attention(q, k, v, tables, lens, 0.125)
y = torch.randn(3, 128)
ok = torch.allclose(got, want, atol=1e-5) and torch.allclose(
    cpu.op("silu_and_mul")(y), reference.silu_and_mul(y), atol=1e-5)
print("ops match the reference under Haswell-v4" if ok else "MISMATCH")
sys.exit(0 if ok else 1)
PY
else
  echo "== qemu-x86_64: not installed, skipped"
fi
exit $status
