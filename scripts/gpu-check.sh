#!/usr/bin/env bash
# The GPU check (one command, under 10 minutes on one H200): the benchmarks at real size with --device cuda, the
# algorithm tests on CUDA (pytest marker `cuda`) and `stare run --preset tiny-cpu --set device=cuda`, into one JSON
# file of figures (default runs/gpu-check/gpu-check.json). For a stock CUDA PyTorch image with this package installed by
#   pip install --no-deps --no-build-isolation -e .
# Steps whose modules are missing are skipped and named. `--dry-run` prints the plan; `--help` for the flags.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
exec "$PYTHON" scripts/gpu_check.py "$@"
