"""Where the real-vLLM CPU environment is (``scripts/vllm-cpu-env.sh`` makes it), and the module-level skip of the
tests that run in it (tests/test_vllm_cpu.py, tests/test_openrlhf_e2e.py): skipped with the reason where it is
absent or its install failed, a failure with ``STARE_REQUIRE_VLLM_CPU=1``."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV_DIR = Path(os.environ.get("STARE_VLLM_CPU_ENV") or REPO / ".vllm-cpu-env")
ENV_PY = ENV_DIR / "bin" / "python"
ENV_STARE = ENV_DIR / "bin" / "stare"
SETUP = "bash scripts/vllm-cpu-env.sh"


def absent_reason(*, openrlhf: bool = False) -> str | None:
    """Why the environment cannot run the tests (None: it can); ``openrlhf``: it must hold OpenRLHF too."""
    error = os.environ.get("STARE_VLLM_CPU_ENV_ERROR")
    if error:
        return f"the vLLM CPU environment could not be installed ({error}); see {SETUP}"
    if not (ENV_PY.exists() and ENV_STARE.exists() and (ENV_DIR / ".stare-stamp").exists()):
        return f"no vLLM CPU environment at {ENV_DIR} (create it with: {SETUP})"
    if openrlhf and not list((ENV_DIR / "lib").glob("python3*/site-packages/openrlhf")):
        return f"the environment at {ENV_DIR} has no OpenRLHF (re-create it with: {SETUP})"
    return None


def skip_module_unless_present(*, openrlhf: bool = False) -> None:
    """Called at a test module's import: skip the module, or fail with ``STARE_REQUIRE_VLLM_CPU=1``."""
    reason = absent_reason(openrlhf=openrlhf)
    if reason is None:
        return
    if os.environ.get("STARE_REQUIRE_VLLM_CPU") == "1":
        raise RuntimeError(reason)
    pytest.skip(reason, allow_module_level=True)
