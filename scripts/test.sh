#!/usr/bin/env bash
# Runs the whole test suite (slow tests included) in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q "$@"
