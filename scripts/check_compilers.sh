#!/usr/bin/env bash
# Builds the CPU C++ library with each compiler given (default: g++-11, the oldest supported
# GCC, and clang++; Debian: apt-get install g++-11 clang libomp-dev) into a cache folder of
# its own, and runs the C++ op tests against each build. CI builds with the machine's c++ and
# x86-64-v3 (tests/test_cpu_build.py); this is the check for the other compilers' paths.
#   bash scripts/check_compilers.sh [COMPILER ...]
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
exit $status
