"""Fast help: `stare --help`, `--version`, `presets` and `algos` import no torch, transformers or vLLM (each costs
seconds of import time before anything is parsed). The time itself is benchmarks/bench_cli_help.py's, not a test."""
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "vllm")
PROBE = """
import sys
from stare.cli.main import app
try:
    app(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
else:
    code = 0
heavy = [m for m in {heavy!r} if m in sys.modules]
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["presets"], ["algos"], ["algos", "--settings"],
                                  ["train", "--help"], ["eval", "--help"]])
def test_help_and_listings_import_no_torch(args):
    res = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *args], capture_output=True, text=True,
                         cwd="/")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip(), "the command printed nothing"
    assert "HEAVY=\n" in res.stderr or res.stderr.rstrip().endswith("HEAVY="), res.stderr[-2000:]


def test_the_probe_sees_a_heavy_import():
    """The probe above can fail: a command that does import torch is reported."""
    res = subprocess.run([sys.executable, "-c", "import torch\n" + PROBE.format(heavy=HEAVY), "--version"],
                         capture_output=True, text=True, cwd="/")
    assert "HEAVY=torch" in res.stderr, res.stderr[-2000:]


def test_every_public_name_of_stare_algorithms_still_imports():
    res = subprocess.run([sys.executable, "-c", (
        "import sys, stare.algorithms as a\n"
        "assert 'torch' not in sys.modules\n"
        "missing = [n for n in a.__all__ if getattr(a, n, None) is None]\n"
        "assert not missing, missing\n"
        "from stare.algorithms import stare_step, policy_loss, AGGREGATIONS, METRICS\n"
        "from stare.algorithms.loss import AGGREGATIONS as agg\n"
        "from stare.algorithms.entropy import KERNELS\n"
        "from stare.algorithms.selection import SELECTIONS, VARIANTS\n"
        "assert agg is AGGREGATIONS and 'cpp' in KERNELS and 'phi' in SELECTIONS and 'C2' in VARIANTS\n"
        "print(len(a.__all__), sorted(set(a.__all__) - set(dir(a))))\n")], capture_output=True, text=True, cwd="/")
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[1:] == ["[]"], res.stdout
