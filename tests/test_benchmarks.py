"""The plugin-step benchmark still runs against OpenRLHF's real trainer (a seconds-long --quick run), and its
report keeps the shape users' scripts read: the last line is the JSON object of the three ratios. The entropy
benchmark's compiled and cpp rows run at a small size."""
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_bench_plugin_step_quick_run_reports_every_variant_and_finds_every_stashed_sample():
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_plugin_step.py"), "--quick"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    ratios = json.loads(lines[-1])
    assert set(ratios) == {"grpo", "stare", "stare-phi"}
    assert all(r > 0 for r in ratios.values())
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in ratios}
    assert set(rows) == set(ratios)
    # the columns: variant, median s, ratio, target, verdict, gate, recomputed, 90% interval
    assert [rows[v][3] for v in ("grpo", "stare", "stare-phi")] == ["1.03", "1.05", "1.10"]
    assert rows["grpo"][5] == "-" and rows["stare"][5] == "on" and rows["stare-phi"][5] == "on"
    # every sample's statistics came from the old-log-prob forward's stash: no extra forward
    assert all(rows[v][6] == "0" for v in rows)
    # the ratio's 90% interval (a paired bootstrap over the repeats) holds the ratio itself
    for v in rows:
        low, high = map(float, rows[v][7].split("-"))
        assert low <= float(rows[v][2]) <= high, rows[v]
    again = next(line for line in lines if line.startswith("openrlhf again"))
    assert float(again.split()[3]) > 0  # the A/A row: OpenRLHF's own step timed twice
    # the plugin's extra work timed where it runs: each variant's statistics and once-per-step block, in ms
    in_place = next(line for line in lines if line.strip().startswith("in place:"))
    for v in rows:
        assert re.search(rf"{v} \d+\.\d \+ \d+\.\d = \+\d+\.\d%", in_place), in_place
    assert any(line.strip().startswith("allocator:") for line in lines)
    # the plugin's statistics in the fused C++ kernel by default, or auto with a line that says why not
    header = next(line for line in lines if line.startswith("one RL step"))
    assert "stats kernel cpp" in header or "the default cpp could not be built" in res.stdout, header


def test_keep_freed_memory_says_what_it_did():
    code = "import sys; sys.path.insert(0, 'benchmarks'); import _timing; print(_timing.keep_freed_memory())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip()
    assert line.startswith("allocator: ")
    if platform.libc_ver()[0] == "glibc":
        assert "stay in the process" in line  # glibc accepted the settings


@pytest.mark.parametrize("kernel", ["compiled", "cpp"])
def test_bench_entropy_fused_row_agrees_and_allocates_nothing_per_logit(kernel):
    """``--kernel compiled`` (or ``cpp``) adds that kernel's row beside the chunked one (small sizes: a smoke run;
    the ratios at this size mean nothing), with its own RESULT fields, and the compiler's memory kept out of the
    call's: the fused kernel itself allocates only its [N] outputs, far below one [N, V] float32 buffer."""
    n, vocab = 512, 32768  # 64 MiB of logits: above the compiler's own transient memory (a high-water mark)
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_entropy.py"), "--kernel", kernel,
                          "--n", str(n), "--vocab", str(vocab), "--repeats", "1", "--mem-repeats", "1"],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert result["kernel"] == kernel and result[f"{kernel}_ms"] > 0 and result["chunked_ms"] > 0
    assert all(d < 1e-4 for d in result[f"{kernel}_max_abs_diff"].values()), result[f"{kernel}_max_abs_diff"]
    # below one [N, V] float32 buffer (64 MiB) and below the torch path's two 4 MiB chunk buffers
    assert result[f"{kernel}_extra_mib"] < 4, result[f"{kernel}_extra_mib"]


def _benchmark_module(name: str):
    """A module of benchmarks/ (they import each other by bare name)."""
    import importlib

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _timing():
    return _benchmark_module("_timing")


def test_ratio_interval_keeps_each_round_together():
    """A round that slows every variant alike moves both medians together: with the variant 1.05x the base in every
    round, however much the rounds differ, the paired interval is 1.05 exactly (resampling the two lists apart
    would spread it over the rounds' differences)."""
    base = [0.2, 0.35, 0.21, 0.5, 0.19, 0.3, 0.26]
    low, high = _timing().ratio_interval([1.05 * b for b in base], base)
    assert abs(low - 1.05) < 1e-12 and abs(high - 1.05) < 1e-12


def test_ratio_interval_matches_the_enumerated_bootstrap_distribution():
    """Six rounds have 6^6 equally likely resamples: the interval's ends lie near the 5th and 95th percentiles of
    the ratio over all of them, computed here by enumeration (and strictly inside the range of all of them)."""
    import itertools
    import statistics

    base = [1.0, 1.3, 0.9, 1.1, 1.2, 0.95]
    variant = [1.2, 1.25, 1.0, 1.5, 1.45, 1.1]
    ratios = sorted(statistics.median([variant[i] for i in pick]) / statistics.median([base[i] for i in pick])
                    for pick in itertools.product(range(6), repeat=6))
    last = len(ratios) - 1
    low, high = _timing().ratio_interval(variant, base, resamples=4000)
    assert ratios[int(0.02 * last)] <= low <= ratios[int(0.08 * last)]
    assert ratios[int(0.92 * last)] <= high <= ratios[int(0.98 * last)]
    assert ratios[0] < low and high < ratios[-1]


def test_ratio_interval_rejects_unpaired_times():
    with pytest.raises(ValueError, match="one time per repeat"):
        _timing().ratio_interval([1.0, 2.0], [1.0])


def _loop_bench():
    return _benchmark_module("bench_openrlhf_loop")


def test_loop_benchmark_reads_openrlhfs_step_timings_from_tensorboard(tmp_path):
    """The loop benchmark's figures are OpenRLHF's own per-step timings as its TensorBoard logger writes them
    (`train/` prefix, one scalar per step); other tags are ignored and a later event file wins."""
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "tensorboard" / "run"
    with SummaryWriter(str(run)) as w:
        for step in range(1, 4):
            w.add_scalar("train/timing/ppo_train", 0.5 * step, step)
            w.add_scalar("train/timing/make_experience", 0.25 + step, step)
            w.add_scalar("train/timing/generation", 9.0, step)
    times = _loop_bench().step_times(tmp_path)
    assert times == {"timing/ppo_train": {1: 0.5, 2: 1.0, 3: 1.5}, "timing/make_experience": {1: 1.25, 2: 2.25,
                                                                                              3: 3.25}}


def test_loop_benchmark_interval_matches_the_enumerated_bootstrap():
    """Unpaired: each arm's steps resampled on their own. With 4 and 3 steps there are 4^4 x 3^3 equally likely
    resamples; the interval's ends lie within the enumerated distribution's 2nd-8th and 92nd-98th percentiles."""
    import itertools
    import statistics

    variant, base = [1.1, 1.3, 1.0, 1.6], [1.0, 1.2, 0.9]
    ratios = sorted(statistics.median(v) / statistics.median(b) for v in itertools.product(variant, repeat=4)
                    for b in itertools.product(base, repeat=3))
    low, high = _loop_bench().ratio_interval_unpaired(variant, base, resamples=20000)
    q = lambda f: ratios[int(f * (len(ratios) - 1))]  # noqa: E731
    assert q(0.02) <= low <= q(0.08) and q(0.92) <= high <= q(0.98), (low, high, q(0.05), q(0.95))
