"""The plugin-step benchmark still runs against OpenRLHF's real trainer (a seconds-long --quick run), and its
report keeps the shape users' scripts read: the last line is the JSON object of the three ratios. The entropy
benchmark's compiled row runs at a small size."""
import json
import platform
import subprocess
import sys
from pathlib import Path

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
    # the columns: variant, median s, ratio, target, verdict, gate, recomputed
    assert [rows[v][3] for v in ("grpo", "stare", "stare-phi")] == ["1.03", "1.05", "1.10"]
    assert rows["grpo"][5] == "-" and rows["stare"][5] == "on" and rows["stare-phi"][5] == "on"
    # every sample's statistics came from the old-log-prob forward's stash: no extra forward
    assert all(rows[v][6] == "0" for v in rows)
    again = next(line for line in lines if line.startswith("openrlhf again"))
    assert float(again.split()[3]) > 0  # the A/A row: OpenRLHF's own step timed twice
    assert any(line.strip().startswith("allocator:") for line in lines)


def test_keep_freed_memory_says_what_it_did():
    code = "import sys; sys.path.insert(0, 'benchmarks'); import _timing; print(_timing.keep_freed_memory())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip()
    assert line.startswith("allocator: ")
    if platform.libc_ver()[0] == "glibc":
        assert "stay in the process" in line  # glibc accepted the settings


def test_bench_entropy_compiled_row_agrees_and_allocates_nothing_per_logit():
    """``--kernel compiled`` adds the torch.compile'd kernel's row beside the chunked one (small sizes: a smoke run;
    the ratios at this size mean nothing), with its own RESULT fields, and the compiler's memory kept out of the
    call's: the fused kernel itself allocates only its [N] outputs, far below one [N, V] float32 buffer."""
    n, vocab = 512, 32768  # 64 MiB of logits: above the compiler's own transient memory (a high-water mark)
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_entropy.py"), "--kernel", "compiled",
                          "--n", str(n), "--vocab", str(vocab), "--repeats", "1", "--mem-repeats", "1"],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert result["kernel"] == "compiled" and result["compiled_ms"] > 0 and result["chunked_ms"] > 0
    assert all(d < 1e-4 for d in result["compiled_max_abs_diff"].values()), result["compiled_max_abs_diff"]
    # below one [N, V] float32 buffer (64 MiB) and below the torch path's two 4 MiB chunk buffers
    assert result["compiled_extra_mib"] < 4, result["compiled_extra_mib"]
