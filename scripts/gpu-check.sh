#!/usr/bin/env bash
# The GPU check (one command, under 10 minutes on one H200): the fused Triton kernel at 8,192 x 151,936 bf16, the
# algorithm tests on CUDA (pytest marker `cuda`), the memory plan against one training micro-batch of a 1.5B model,
# `stare run --preset tiny-cpu --set device=cuda`, then the other benchmarks at real size, into one JSON file of
# figures and one log. On the lent machine:
#   bash scripts/gpu-check.sh --out "$OUT/gpu-check" --budget 500
# Nothing needs installing: stare is imported from this working tree (a path mapping), and the wheels in
# gpu-wheels/ (scripts/gpu-wheels.sh), if any, are installed into a temporary folder with --no-index.
# `--dry-run` does that set-up and says whether each step's modules import here; `--help` for the flags.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
exec "$PYTHON" scripts/gpu_check.py "$@"
