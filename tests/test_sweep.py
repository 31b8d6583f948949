"""`stare run --sweep`: folders and names, the same runs as `stare train --set` by hand, resume, the dose-response
table against numbers computed here from the runs' files, the trend test against brute force, and the refusals."""
from __future__ import annotations

import itertools
import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stare.eval import metrics as metrics_mod
from stare.eval.metrics import spearman_trend

# small enough for seconds per arm on two cores (as test_local_engine's FAST), the gate held open so W acts
FAST = ["warmstart_steps=100", "warmstart_noise=0.3", "eval_problems=8", "prompts_per_step=4", "samples_per_prompt=4",
        "train_problems=200", "micro_batch_size=8", "steps=6", "save_every=4", "target_entropy=10"]
SETS = sum((["--set", s] for s in FAST), [])
GPU_PRESET = "qwen-7b-short-cot"


def stare(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "stare.cli.main", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def lines(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "time_s"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


# ---- the trend test ---------------------------------------------------------------------------------------------
def _ranks(v):  # 1 + the values below + half the other equal ones: mid-ranks, written another way
    return [1 + sum(u < x for u in v) + (sum(u == x for u in v) - 1) / 2 for x in v]


def _rho(x, y):
    return statistics.correlation(_ranks(x), _ranks(y))  # Pearson's r of the ranks


def _brute_p(x, y):
    """Every one of the n! orders of y, |rho| at least the observed."""
    observed = abs(_rho(x, y))
    perms = list(itertools.permutations(y))
    return sum(abs(_rho(x, list(p))) >= observed - 1e-12 for p in perms) / len(perms)


@pytest.mark.parametrize("x, y", [
    ([1.1, 1.1, 2, 2], [0.5, 0.6, 0.7, 0.8]),  # the CI run's shape: two values x two seeds
    ([1, 1, 2, 2, 4, 4], [0.3, 0.1, 0.4, 0.4, 0.9, 0.2]),  # a tie in y too
    ([1, 2, 3, 4, 5, 6], [2.0, 1.0, 4.0, 3.0, 6.0, 5.0]),  # no ties
    ([8, 8, 8, 1, 1, 1, 2], [0.1, 0.5, 0.2, 0.9, 0.7, 0.8, 0.3]),  # a falling trend, unequal groups
])
def test_the_trend_test_against_brute_force(x, y):
    t = spearman_trend(x, y)
    assert t["exact"] and t["n"] == len(x)
    assert t["rho"] == pytest.approx(_rho(x, y), abs=1e-12)
    assert t["p"] == pytest.approx(_brute_p(x, y), abs=1e-12)


def test_the_trend_test_samples_beyond_its_limit_and_refuses_no_order(monkeypatch):
    x = [1, 1, 1, 2, 2, 2, 4, 4]
    y = [0.2, 0.1, 0.35, 0.3, 0.5, 0.25, 0.6, 0.45]
    exact = spearman_trend(x, y)
    assert exact["exact"] and exact["p"] == pytest.approx(_brute_p(x, y), abs=1e-12)
    monkeypatch.setattr(metrics_mod, "EXACT_LIMIT", 300)  # 560 splits: sampled now
    sampled = spearman_trend(x, y)
    assert not sampled["exact"] and sampled["rho"] == exact["rho"]
    assert abs(sampled["p"] - exact["p"]) < 0.08  # 300 draws: a few standard errors
    assert spearman_trend([1, 1, 1], [1, 2, 3]) is None and spearman_trend([1, 2, 3], [5, 5, 5]) is None
    assert spearman_trend([1, 2], [1, 2]) is None


# ---- the refusals: one line, exit 2, nothing written ------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--sweep", "w"], "--sweep 'w': expected KEY=V1,V2,..."),
    (["--sweep", "w=1.1,"], "an empty value"),
    (["--sweep", "w=1/2"], "value '1/2' cannot be part of a folder name"),
    (["--sweep", "ww=1,2"], "unknown --set key 'ww'; valid keys:"),
    (["--sweep", "w=-1,2"], "w must be in (0, inf], got -1.0"),
    (["--sweep", "w=2,2.0"], "--sweep w: 2 and 2.0 are the same value"),
    (["--sweep", "w=2,2"], "lists a value twice"),
    (["--sweep", "w=1.1", "--sweep", "w=2"], "--sweep w is given twice"),
    (["--sweep", "w=1.1,2", "--set", "w=1.5"], "--sweep w and --set w are both given"),
    (["--sweep", "seeds=1,2"], "use --seeds"),
    (["--algos", "grpo,stare", "--sweep", "w=1.1,2"], "--sweep w: not a setting of grpo: only STARE algorithms use "
                                                       "it"),
    (["--algos", "stare", "--sweep", "band_low=0.2,0.3"], "not a setting of stare: only the band controller uses it"),
])
def test_refusals_are_one_line_exit_2_and_write_nothing(tmp_path, args, message):
    algos = [] if "--algos" in args else ["--algos", "stare"]
    res = stare("run", "--preset", "tiny-cpu", "--out", tmp_path / "out", *algos, *args)
    assert res.returncode == 2, res.stderr
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "out").exists()


def test_a_gpu_preset_sweep_plans_one_training_per_value(tmp_path):
    res = stare("run", "--preset", GPU_PRESET, "--out", tmp_path / "out", "--algos", "stare", "--sweep", "w=1.1,2",
                "--sweep", "top_ratio=0.1,0.3", "--seeds", "1", "--dry-run")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    out = (tmp_path / "out").absolute()
    labels = ["stare[w=1.1,top_ratio=0.1]", "stare[w=1.1,top_ratio=0.3]", "stare[w=2,top_ratio=0.1]",
              "stare[w=2,top_ratio=0.3]"]
    assert plan["arms"] == labels
    trains = [s for s in plan["steps"] if s["step"] == "train"]
    assert [s["out"] for s in trains] == [str(out / a / "seed0") for a in labels]
    for s, (w, top) in zip(trains, itertools.product(["1.1", "2"], ["0.1", "0.3"])):
        cmd = s["command"]
        assert cmd[cmd.index("--algo") + 1] == "stare"
        assert [cmd[i + 1] for i, c in enumerate(cmd) if c == "--set"] == [f"w={w}", f"top_ratio={top}", "seed=42"]


# ---- the CPU run: stare run --preset tiny-cpu --algos stare --sweep w=1.1,2 --seeds 2 -------------------------
@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    out = root / "sweep"
    res = stare("run", "--preset", "tiny-cpu", "--algos", "stare", "--sweep", "w=1.1,2", "--seeds", "2", "--out", out,
                *SETS)
    assert res.returncode == 0, res.stderr[-3000:]
    return root, out, res


ARMS = {"stare[w=1.1]": 1.1, "stare[w=2]": 2.0}


def test_the_sweep_trains_one_arm_per_value_in_its_own_folders(swept):
    root, out, res = swept
    for arm, w in ARMS.items():
        for s in range(2):
            cfg = yaml.safe_load((out / arm / f"seed{s}" / "config.yaml").read_text())
            assert cfg["algo"]["name"] == "stare" and cfg["algo"]["w"] == w and cfg["settings"]["seed"] == s
            assert (out / arm / f"seed{s}" / "eval.json").exists()
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["stare[w=1.1]", "stare[w=2]", "warmstart"]
    assert (out / "dose_response.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "stare[w=1.1], stare[w=2] x 2 seed(s)" in res.stdout  # named as typed, not eaten as rich markup
    # W acted: the gate was open and the two arms' first updates differ
    assert lines(out / "stare[w=1.1]" / "seed0")[1] != lines(out / "stare[w=2]" / "seed0")[1]
    summary = json.loads((out / "comparison.json").read_text())
    assert [a["label"] for a in summary["arms"]] == list(ARMS)
    assert [a["sweep"] for a in summary["arms"]] == [{"w": 1.1}, {"w": 2.0}]


def test_each_swept_run_is_the_run_stare_train_set_makes_by_hand(swept):
    root, out, _ = swept
    hand = root / "hand"
    arm, w, s = "stare[w=2]", "2", 1  # one run by hand: the others differ from it in w or the seed alone
    res = stare("train", "--preset", "tiny-cpu", "--algo", "stare", "--set", f"w={w}", "--set", f"seed={s}",
                *SETS, "--out", hand / arm / f"seed{s}")
    assert res.returncode == 0, res.stderr[-2000:]
    assert lines(hand / arm / f"seed{s}") == lines(out / arm / f"seed{s}")
    assert json.loads((hand / arm / f"seed{s}" / "eval.json").read_text()) == \
        json.loads((out / arm / f"seed{s}" / "eval.json").read_text())
    shutil.copytree(out / arm / "seed0", hand / arm / "seed0")  # the table, from folders assembled by hand
    shutil.copytree(out / "stare[w=1.1]", hand / "stare[w=1.1]")
    res = stare("compare", hand, "--out", root / "cmp")
    assert res.returncode == 0, res.stderr
    by_hand = json.loads((root / "cmp" / "comparison.json").read_text())["dose_response"]
    assert by_hand == json.loads((out / "comparison.json").read_text())["dose_response"]
    assert (root / "cmp" / "dose_response.png").exists()


def _late(rows, key):  # the mean of the last quarter of the steps (rounded up)
    n = math.ceil(len(rows) / 4)
    return statistics.fmean(r[key] for r in rows[-n:])


def test_the_dose_response_table_against_the_runs_files(swept):
    _, out, _ = swept
    series = json.loads((out / "comparison.json").read_text())["dose_response"]
    assert len(series) == 1 and series[0]["algo"] == "stare" and series[0]["key"] == "w"
    s = series[0]
    assert [r["value"] for r in s["rows"]] == [1.1, 2.0]
    xs, ys = {}, {}
    for row, arm in zip(s["rows"], ARMS):
        per_seed = {"late_entropy": [], "avg_at_k": []}
        for seed in range(2):
            run = out / arm / f"seed{seed}"
            per_seed["late_entropy"].append(_late(lines(run), "stare/entropy"))
            per_seed["avg_at_k"].append(json.loads((run / "eval.json").read_text())["avg_at_8"])
        for m, vals in per_seed.items():
            mean = statistics.fmean(vals)
            half = 12.706 * statistics.stdev(vals) / math.sqrt(2)  # t(0.975, 1)
            assert row[m]["mean"] == pytest.approx(mean, abs=1e-12) and row[m]["n"] == 2
            high = mean + half if m == "late_entropy" else min(1.0, mean + half)  # clipped: avg@k <= 1, H >= 0
            assert row[m]["ci95"] == pytest.approx([max(0.0, mean - half), high], abs=1e-9)
            xs.setdefault(m, []).extend([ARMS[arm]] * 2)
            ys.setdefault(m, []).extend(vals)
    for m in ("late_entropy", "avg_at_k"):
        t = s["trend"][m]
        if len(set(ys[m])) < 2:
            assert t is None
            continue
        assert t["rho"] == pytest.approx(_rho(xs[m], ys[m]), abs=1e-12)
        assert t["p"] == pytest.approx(_brute_p(xs[m], ys[m]), abs=1e-12)
    md = (out / "comparison.md").read_text()
    assert "## Dose-response" in md and "| stare[w=1.1] | 2 |" in md and "| stare[w=2] | 2 |" in md


def test_a_resumed_sweep_keeps_what_finished_and_redoes_only_the_rest(swept, tmp_path):
    _, out, _ = swept
    copy = tmp_path / "sweep"
    shutil.copytree(out, copy)
    before = {(a, s): lines(copy / a / f"seed{s}") for a in ARMS for s in range(2)}
    kept = (copy / "stare[w=1.1]" / "seed0" / "metrics.jsonl").stat().st_mtime_ns
    shutil.rmtree(copy / "stare[w=2]" / "seed1")  # never started
    (copy / "stare[w=1.1]" / "seed1" / "eval.json").unlink()  # interrupted after its last checkpoint
    res = stare("run", "--preset", "tiny-cpu", "--algos", "stare", "--sweep", "w=1.1,2", "--seeds", "2", "--out", copy,
                *SETS, "--dry-run", "--resume")
    states = {(r["arm"], r["seed"]): r["state"] for r in json.loads(res.stdout)["steps"]}
    assert states == {("stare[w=1.1]", 0): "kept", ("stare[w=1.1]", 1): "resume", ("stare[w=2]", 0): "kept",
                      ("stare[w=2]", 1): "new"}
    res = stare("run", "--preset", "tiny-cpu", "--algos", "stare", "--sweep", "w=1.1,2", "--seeds", "2", "--out", copy,
                *SETS, "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert {(a, s): lines(copy / a / f"seed{s}") for a in ARMS for s in range(2)} == before
    assert (copy / "stare[w=1.1]" / "seed0" / "metrics.jsonl").stat().st_mtime_ns == kept
    assert json.loads((copy / "comparison.json").read_text())["dose_response"] == \
        json.loads((out / "comparison.json").read_text())["dose_response"]
    # another sweep into this folder: its arms are other runs, refused before anything is written
    res = stare("run", "--preset", "tiny-cpu", "--algos", "stare", "--sweep", "w=1.1,2", "--seeds", "2", "--out", copy,
                *SETS, "--set", "lr=0.01", "--resume")
    assert res.returncode == 2 and "was started with other settings" in res.stderr


def test_a_folder_whose_name_and_config_disagree_is_not_a_swept_arm(swept, tmp_path):
    _, out, _ = swept
    from stare.cli.report.runs import load_run
    from stare.cli.sweep import arm_sweep

    run = load_run(out / "stare[w=2]" / "seed0")
    assert arm_sweep(run.path, run.config, run.algo) == ("stare[w=2]", {"w": 2.0})
    renamed = tmp_path / "stare[w=3]" / "seed0"
    shutil.copytree(out / "stare[w=2]" / "seed0", renamed)
    assert arm_sweep(renamed, run.config, run.algo) is None  # w is 2 in its config.yaml
    assert arm_sweep(renamed, run.config, "grpo") is None
