"""Run a command where a process may not create user namespaces, as under Docker's default seccomp profile.

The sandbox finds out by its supervisor's ``unshare(CLONE_NEWUSER | ...)`` failing; this makes that call fail the
same way. On a machine with user namespaces the command runs in a user namespace of its own (``unshare --user
--map-root-user``) whose limit on nested ones is 0 (``/proc/sys/user/max_user_namespaces`` is per user namespace),
so the sandbox's ``unshare`` fails with ENOSPC; on a machine without them the command runs as it is.

Imported by the test files as ``from no_userns import ...`` (tests/ is on sys.path, not a package).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

PROBE = "from stare.cli.agent.sandbox import namespaces_available; print(namespaces_available()[0])"
WRAP = ["unshare", "--user", "--map-root-user", "sh", "-c",
        'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"', "sh"]


def without_userns(argv: list[str], namespaces_here: bool) -> list[str] | None:
    """``argv`` wrapped to run without user namespaces (``namespaces_here``: whether this machine has them), or None
    when that cannot be arranged here (no ``unshare`` tool, or it does not work, or the probe still finds them)."""
    if not namespaces_here:
        return list(argv)
    if shutil.which("unshare") is None:
        return None
    res = subprocess.run([*WRAP, sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    if res.returncode != 0 or res.stdout.strip() != "False":
        return None
    return [*WRAP, *argv]


def run_json_without_userns(code: str, *args: str, namespaces_here: bool, timeout: float = 600) -> dict:
    """Run ``python -c code args`` without user namespaces and return the JSON object its last line prints; the
    calling test is skipped where that cannot be arranged."""
    argv = without_userns([sys.executable, "-c", code, *args], namespaces_here)
    if argv is None:
        pytest.skip("cannot run a process without user namespaces here (no working `unshare --user`)")
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
