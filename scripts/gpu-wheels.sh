#!/usr/bin/env bash
# The wheel folder the GPU check installs from on the lent machine (no network there): wheels of the packages a
# step needs that the machine lacks, for its Python (3.12, manylinux x86_64), into gpu-wheels/ (gitignored).
#
#   bash scripts/gpu-wheels.sh PKG==VERSION ...    # e.g. a package a dry run there named as missing
#
# Today no step needs one: the machine (as last read: torch 2.11, triton 3.6.0, transformers 5.17.0, typer, rich,
# pyyaml, matplotlib, numpy, pytest, setuptools) has every module the steps import, which the simulated-device test
# (tests/test_gpu_check.py) checks; with no arguments this script says so and leaves the folder empty.
# The folder travels only when the device tool's `carry` names it (carry: ["gpu-wheels"]); it must stay well under
# the 64 MiB the working tree may take, so packages go in with --no-deps (name each one you need).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${STARE_GPU_WHEELS:-gpu-wheels}
PY_VERSION=${STARE_GPU_PYTHON:-3.12}
LIMIT_MB=48
mkdir -p "$DEST"
if [[ $# -eq 0 ]]; then
  echo "nothing to carry: every step's modules are on the lent machine; $DEST/ left as it is ($(ls "$DEST" | wc -l) files)"
  exit 0
fi
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$PY_VERSION" --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --implementation cp --dest "$DEST" "$@"
size_mb=$(du -sm "$DEST" | cut -f1)
if (( size_mb > LIMIT_MB )); then
  echo "error: $DEST/ holds ${size_mb} MB, over the ${LIMIT_MB} MB this script allows (the working tree may take 64 MiB in all)" >&2
  exit 1
fi
echo "$DEST/: $(ls "$DEST"/*.whl | wc -l) wheels, ${size_mb} MB; carry it: the device tool's carry [\"$DEST\"]"
