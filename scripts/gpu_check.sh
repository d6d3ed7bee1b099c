#!/usr/bin/env bash
# Run first on a machine with GPUs: every family on cuda in 32-true, 16-mixed and bf16-mixed, and on
# two GPUs with clients in parallel, with a pass/fail table (scripts/gpu_check.py), then the local
# step's time with the sequential and the vectorised engine. Without a GPU it runs the CPU part
# (--engines adds the engine timing there), says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PY" scripts/gpu_check.py "$@"
