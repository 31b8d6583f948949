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


def _extra_requirements(dist_requires, extra):
    """The requirements a distribution lists for ``extra`` only (not its base ones)."""
    from packaging.requirements import Requirement

    out = []
    for line in dist_requires or []:
        req = Requirement(line)
        if req.marker is not None and req.marker.evaluate({"extra": extra}) and not req.marker.evaluate({"extra": ""}):
            out.append(req)
    return out


def test_lm_eval_extra_brings_what_lm_evals_hf_model_imports():
    """`pip install -e ".[lm-eval]"` then `--harness lm-eval --backend hf`: lm-eval's hf model imports accelerate,
    which lm-eval lists only under its own `hf` extra. Our extra must cover every requirement of that extra,
    read from the installed lm-eval's metadata (CI installs lm-eval 0.4.13)."""
    from importlib import metadata

    import pytest
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    ours = [Requirement(r) for r in project["optional-dependencies"]["lm-eval"]]
    lm = [r for r in ours if canonicalize_name(r.name) == "lm-eval"]
    assert len(lm) == 1 and str(lm[0].specifier) == "==0.4.13"
    try:
        dist = metadata.distribution("lm_eval")
    except metadata.PackageNotFoundError:
        pytest.skip("lm-eval is not installed (scripts/test.sh installs it)")
    assert dist.version in lm[0].specifier, f"installed lm-eval {dist.version} is not the pinned one"
    needed = _extra_requirements(dist.requires, "hf")
    assert {canonicalize_name(r.name) for r in needed} >= {"accelerate", "transformers", "torch"}  # sanity
    covered = {canonicalize_name(r.name) for r in ours}
    covered |= {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    if "hf" in lm[0].extras:
        covered |= {canonicalize_name(r.name) for r in needed}
    missing = sorted(canonicalize_name(r.name) for r in needed if canonicalize_name(r.name) not in covered)
    assert not missing, f"the lm-eval extra misses lm-eval's hf requirements: {missing}"
