#!/usr/bin/env bash
# Starts the server on the embedded SmolLM2 (extra arguments go to `python -m server`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m server --host 127.0.0.1 --port 8000 "$@"
