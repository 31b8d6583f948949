"""The GPU check's CPU side: its dry run, and the device switch that runs the algorithm tests on a GPU.

No GPU here: the switch is exercised with torch's ``meta`` device, which needs none; the real run is
``bash scripts/gpu-check.sh`` on a GPU machine.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ALGORITHM_TESTS, TestCodeOnDevice

REPO = Path(__file__).resolve().parents[1]


def test_factories_called_from_test_code_go_to_the_device_and_library_calls_do_not():
    lib = {}
    exec(compile("import torch\ndef make():\n    return torch.zeros(2), torch.Generator()\n",
                 "/not/the/tests/lib.py", "exec"), lib)
    real_generator = torch.Generator
    with TestCodeOnDevice("meta"):
        a, b = torch.zeros(3), torch.tensor([1.0, 2.0])
        c = torch.ones(2, device="cpu")  # an explicit device is kept
        inner, gen = lib["make"]()
        assert isinstance(real_generator(), torch.Generator) and isinstance(torch.Generator | None, object)
    assert a.device.type == "meta" and b.device.type == "meta" and c.device.type == "cpu"
    assert inner.device.type == "cpu" and gen.device.type == "cpu"  # the code under test keeps torch's default
    assert torch.Generator is real_generator and torch.zeros(1).device.type == "cpu"  # all undone on exit


def test_the_cuda_marker_selects_exactly_the_algorithm_tests():
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p",
                          "no:cacheprovider", "tests/test_loss.py", "tests/test_scoring.py", "tests/test_entropy.py"],
                         cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    files = {line.split("::")[0] for line in res.stdout.splitlines() if "::" in line}
    assert files == {"tests/test_loss.py", "tests/test_entropy.py"}
    assert {"test_loss.py", "test_entropy.py"} <= set(ALGORITHM_TESTS)


def test_a_cuda_run_without_a_gpu_is_refused_in_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "--device", "cuda", "-p", "no:cacheprovider",
                          "tests/test_loss.py"], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 4 and "--device cuda: torch sees no CUDA device" in res.stderr


def gpu_check(*args):
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), *args], cwd=REPO, capture_output=True,
                          text=True)


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    out = tmp_path / "check"
    res = gpu_check("--dry-run", "--out", str(out))
    assert res.returncode == 0, res.stderr
    text = res.stdout
    # the benchmarks at real size on CUDA
    entropy = next(line for line in text.splitlines() if "benchmarks/bench_entropy.py" in line)
    for flag in ("--device cuda", "--n 32768", "--vocab 151936", "--dtype bf16"):
        assert flag in entropy, flag
    assert "benchmarks/bench_weighted_loss.py --device cuda" in text
    assert "benchmarks/bench_selection.py --device cuda" in text
    # the algorithm tests on CUDA, every one of them, and the local engine end to end
    tests_line = next(line for line in text.splitlines() if " -m pytest " in line)
    assert "-m cuda --device cuda" in tests_line
    assert all(f"tests/{name}" in tests_line for name in ALGORITHM_TESTS)
    run_line = next(line for line in text.splitlines() if "stare.cli.main run --preset tiny-cpu" in line)
    assert "--set device=cuda" in run_line  # the local engine on the GPU, not on CPU threads
    assert str(out / "gpu-check.json") in text
    assert not out.exists()  # nothing ran, nothing was written


def test_bad_flags_fail_in_one_line(tmp_path):
    res = gpu_check("--only", "bench-nope", "--dry-run")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--only" in res.stderr
    assert "bench-entropy" in res.stderr  # the valid choices are named
    if not torch.cuda.is_available():
        res = gpu_check("--out", str(tmp_path / "x"))
        assert res.returncode == 2 and "no CUDA device" in res.stderr and not (tmp_path / "x").exists()


def test_result_parsing_reads_the_benchmarks_last_line_and_junit(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    assert gpu_check.parse_result('x\nRESULT {"a": 1}\nRESULT {"b": 2}\ntrailing\n') == {"b": 2}
    assert gpu_check.parse_result("no result") is None
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                   '<testcase classname="tests.test_loss" name="test_a"><failure/></testcase>'
                   '<testcase classname="tests.test_loss" name="test_b"/></testsuite></testsuites>')
    assert gpu_check.parse_junit(xml) == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1,
                                          "failed": ["tests.test_loss::test_a"]}
