"""Version pins that must agree: the Dockerfile's GPU stack vs pyproject's `openrlhf` extra."""
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PIN = re.compile(r'"?([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([0-9][^"\s]*)"?')


def pins(lines):
    return {m.group(1).lower(): m.group(2) for line in lines for m in PIN.finditer(line)}


def test_dockerfile_pins_equal_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = pins(project["optional-dependencies"]["openrlhf"] + project["dependencies"])
    docker = pins(line for line in (REPO / "Dockerfile").read_text().splitlines() if line.startswith("RUN"))
    for name in ("openrlhf", "ray", "deepspeed", "vllm", "torch", "transformers"):
        assert name in wanted, name
        assert docker.get(name) == wanted[name], f"{name}: Dockerfile {docker.get(name)} vs pyproject {wanted[name]}"


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/test.sh" in ci
