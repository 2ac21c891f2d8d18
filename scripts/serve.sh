#!/usr/bin/env bash
# Starts the server on the embedded SmolLM2 (extra arguments go to `tritonserve serve`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/tritonserve serve --host 127.0.0.1 --port 8000 "$@"
