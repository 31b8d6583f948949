#!/usr/bin/env bash
# The full test suite, from a fresh machine: installs what the tests need, then runs pytest.
# torch is installed first and pinned: on these machines torch==2.13.0 is a local CPU wheel, while an
# unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
python3 -m pip install --quiet "torch==2.13.0"
python3 -m pip install --quiet -e ".[test]"
python3 -m pytest -q "$@"
