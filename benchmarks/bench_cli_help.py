"""Wall time of ``stare --help`` in a fresh interpreter, as a ratio to ``python -c "import torch"``.

The CLI imports torch, transformers and vLLM only inside the commands that need them, so its help (and
``--version``, ``presets``, ``algos``) costs the interpreter, typer and rich, not torch's seconds of import time.
Each sample is one fresh process of each variant, interleaved (``stare --help`` as the console script runs it:
``python -m stare.cli.main --help``; ``python -c "import torch"``); medians.

Target: stare --help / import torch <= 0.3.

    python benchmarks/bench_cli_help.py [--repeats 15]
"""
from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time

from _timing import BackgroundLoad, median, print_result, verdict

TARGET = 0.3

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--repeats", type=int, default=15, help="fresh processes per variant (default 15)")
args = parser.parse_args()

VARIANTS = {
    "stare --help": [sys.executable, "-m", "stare.cli.main", "--help"],
    "import torch": [sys.executable, "-c", "import torch"],
}


def once(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


load = BackgroundLoad()
for cmd in VARIANTS.values():  # warm-up: the files in the page cache, bytecode compiled
    once(cmd)
times: dict[str, list[float]] = {name: [] for name in VARIANTS}
for i in range(args.repeats):
    order = list(VARIANTS) if i % 2 == 0 else list(reversed(VARIANTS))  # interleaved, alternating first
    for name in order:
        times[name].append(once(VARIANTS[name]))
help_s, torch_s = median(times["stare --help"]), median(times["import torch"])
ratio = help_s / torch_s
print(f"python {platform.python_version()}, {args.repeats} fresh processes per variant, interleaved")
print(f"  stare --help   median {help_s * 1000:8.1f} ms")
print(f"  import torch   median {torch_s * 1000:8.1f} ms")
print(f"  ratio {ratio:.3f}  target <= {TARGET}  {verdict(ratio, TARGET)}")
print(load.line())
print_result({"benchmark": "cli_help", "help_s": help_s, "import_torch_s": torch_s, "ratio": ratio,
              "target": TARGET, "verdict": verdict(ratio, TARGET), "background_cores": load.cores()})
