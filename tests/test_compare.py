"""`stare compare` on fixture runs and eval outputs written by hand: numbers, blanks, plots, bad input."""
import csv
import io
import json
import math
import subprocess
import sys

import pytest
import yaml

from stare.cli.report.compare import compare

# small enough for seconds per arm on two cores (as in test_local_engine.py)
FAST = ["warmstart_steps=100", "warmstart_noise=0.3", "eval_problems=8", "prompts_per_step=4", "samples_per_prompt=4",
        "train_problems=200", "micro_batch_size=8",
        "seeds=1"]


def stare(*args):
    return subprocess.run([sys.executable, "-m", "stare.cli.main", *args], capture_output=True, text=True)


def make_run(path, algo, entropies, *, evals=()):
    path.mkdir(parents=True)
    cfg = {"preset": "tiny-cpu", "backend": "local",
           "algo": {"name": algo, "band_low": 0.3, "band_high": 0.45}, "settings": {"model": "tiny", "task": "reverse"}}
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = [{"step": i + 1, "reward_mean": 0.5, "entropy": h, "response_length": 10.0 + i} for i, h in enumerate(entropies)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    for bench, avg in evals:
        e = path / f"eval-{bench}"
        e.mkdir()
        (e / "summary.json").write_text(json.dumps({"bench": bench, "model": str(path / "final"), "k": 4,
                                                    "avg_at_k": avg, "pass_at_k": 0.9, "ci95": {"avg_at_k": [0.1, 0.6]},
                                                    "reflection_per_1k_tokens": 2.5, "mean_response_tokens": 100.0}))


def test_compare_numbers_and_blanks(tmp_path):
    # 20 steps: the last 10% are steps 19-20, the last 25% are steps 16-20
    ent = [0.8] * 15 + [0.35, 0.5, 0.31, 0.2, 0.4]
    make_run(tmp_path / "a", "stare-phi", ent, evals=[("aime24", 0.4), ("aime25", 0.25)])
    make_run(tmp_path / "b", "grpo", [0.1] * 20)
    standalone = tmp_path / "ev"
    standalone.mkdir()
    (standalone / "summary.json").write_text(json.dumps({"bench": "aime25", "model": "some/model", "k": 32,
                                                         "avg_at_k": 0.2, "pass_at_k": 0.5, "ci95": {"avg_at_k": [0.15, 0.25]},
                                                         "mean_response_tokens": 900.0}))
    out = tmp_path / "cmp"
    rows = compare([tmp_path / "a", tmp_path / "b", standalone], out)
    assert len(rows) == 3
    table = list(csv.DictReader((out / "comparison.csv").open()))
    b, a, ev = table  # the registry's order (grpo before stare-phi), then the evaluation of another model
    assert (a["arm"], b["arm"], ev["arm"]) == ("stare-phi", "grpo", "some/model")
    assert float(a["late_entropy_mean"]) == pytest.approx((0.35 + 0.5 + 0.31 + 0.2 + 0.4) / 5)  # the last 25%
    assert float(a["start_entropy_mean"]) == 0.8
    assert float(a["band_share_mean"]) == pytest.approx(3 / 5)  # 0.35, 0.31, 0.4 inside [0.30, 0.45]
    assert float(a["late_response_length_mean"]) == pytest.approx(sum(10.0 + i for i in range(15, 20)) / 5)
    assert float(a["final_reward_mean"]) == 0.5
    assert float(a["aime24_avg_at_k_mean"]) == 0.4 and float(a["aime25_avg_at_k_mean"]) == 0.25 and a["aime24_k"] == "4"
    assert float(a["aime24_ci_low"]) == 0.1 and float(a["aime24_ci_high"]) == 0.6
    assert float(a["reflection_per_1k_tokens_mean"]) == 2.5
    assert b["aime24_avg_at_k_mean"] == "" and b["aime25_avg_at_k_mean"] == "" and float(b["band_share_mean"]) == 0.0
    assert ev["model" if "model" in ev else "arm"] == "some/model" and float(ev["aime25_avg_at_k_mean"]) == 0.2
    assert ev["late_entropy_mean"] == "" and ev["aime24_avg_at_k_mean"] == ""
    md = (out / "comparison.md").read_text()
    assert "| stare-phi | 1 | 0.500 |" in md and "0.400 [0.100, 0.600] (k=4)" in md
    for name in ("entropy.png", "reward.png", "response_length.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "reflection.png").exists()  # no run logged a reflection rate: no empty frame


def test_an_eval_of_a_runs_final_model_joins_its_row(tmp_path):
    make_run(tmp_path / "runs" / "stare", "stare", [0.5] * 8)
    make_run(tmp_path / "runs" / "grpo", "grpo", [0.4] * 8)
    (tmp_path / "runs" / "stare" / "final").mkdir()
    ev = tmp_path / "evals" / "aime25"
    ev.mkdir(parents=True)
    (ev / "summary.json").write_text(json.dumps({"bench": "aime25", "model": str(tmp_path / "runs" / "stare" / "final"),
                                                 "k": 32, "avg_at_k": 0.3, "pass_at_k": 0.6,
                                                 "ci95": {"avg_at_k": [0.2, 0.4]}}))
    rows = compare([tmp_path / "runs", ev], tmp_path / "cmp")
    assert [r["label"] for r in rows] == ["grpo", "stare"]  # no third row for the evaluation
    table = {r["arm"]: r for r in csv.DictReader((tmp_path / "cmp" / "comparison.csv").open())}
    assert float(table["stare"]["aime25_avg_at_k_mean"]) == 0.3 and table["stare"]["aime25_k"] == "32"
    assert table["grpo"]["aime25_avg_at_k_mean"] == ""


def test_arms_of_one_algorithm_with_other_settings_are_separate_rows_with_one_colour(tmp_path):
    from stare.cli.report.plots import colour
    from stare.cli.report.arms import group_arms
    from stare.cli.report.runs import load_run

    make_run(tmp_path / "x" / "stare", "stare", [0.5] * 4)
    make_run(tmp_path / "y" / "stare", "stare", [0.3] * 4)
    cfg = yaml.safe_load((tmp_path / "y" / "stare" / "config.yaml").read_text())
    cfg["settings"]["task"] = "explore"
    (tmp_path / "y" / "stare" / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = compare([tmp_path / "y", tmp_path / "x"], tmp_path / "cmp")
    assert [r["label"] for r in rows] == [f"stare ({tmp_path / 'y' / 'stare'})", f"stare ({tmp_path / 'x' / 'stare'})"]
    groups = group_arms([load_run(tmp_path / "x" / "stare"), load_run(tmp_path / "y" / "stare")])
    assert len(groups) == 2
    from stare.cli.report.plots import palette as plot_palette

    palette = list(range(20))
    names = ("grpo", "dr-grpo", "dapo", "stare", "stare-c2", "stare-phi", "clip-cov", "kl-cov", "80-20",
             "entropy-adaptive", "entropy-adv", "dg", "steer")
    assert [colour(a, palette) for a in names] == list(range(13))  # the registry's order (`stare algos`)
    assert colour(None, palette) == colour("unknown", palette) == 13  # one colour past the registry's
    drawn = [colour(a, plot_palette()) for a in (*names, None)]  # and the plots' colours are all distinct
    assert len(set(drawn)) == len(drawn)


def test_a_repeated_run_is_its_own_row_not_a_duplicate_seed(tmp_path):
    make_run(tmp_path / "runs" / "stare", "stare", [0.5] * 4)
    make_run(tmp_path / "one", "stare", [0.3] * 4)  # the same settings and (no) seed, trained again elsewhere
    rows = compare([tmp_path / "runs", tmp_path / "one"], tmp_path / "cmp")
    assert [r["label"] for r in rows] == [f"stare ({tmp_path / 'runs' / 'stare'})", f"stare ({tmp_path / 'one'})"]
    table = {r["arm"]: r for r in csv.DictReader((tmp_path / "cmp" / "comparison.csv").open())}
    assert float(table[f"stare ({tmp_path / 'one'})"]["late_entropy_mean"]) == 0.3


def test_stare_run_and_stare_compare_write_the_same_table(tmp_path):
    """Both commands on the same run folders: the same rows, columns and numbers."""
    out = tmp_path / "demo"
    sets = sum((["--set", s] for s in FAST + ["steps=4"]), [])
    res = stare("run", "--preset", "tiny-cpu", "--algos", "stare-phi,grpo", "--out", str(out), *sets)
    assert res.returncode == 0, res.stderr[-3000:]
    run_md, run_csv = (out / "comparison.md").read_text(), (out / "comparison.csv").read_text()
    res = stare("compare", str(out), "--out", str(tmp_path / "cmp"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "cmp" / "comparison.md").read_text() == run_md
    assert (tmp_path / "cmp" / "comparison.csv").read_text() == run_csv
    rows = {r["arm"]: r for r in csv.DictReader(io.StringIO(run_csv))}
    assert list(rows) == ["warmstart", "grpo", "stare-phi"]
    for arm in ("grpo", "stare-phi"):  # by hand from metrics.jsonl: late H is the mean over the last 25% of steps
        metrics = [json.loads(x) for x in (out / arm / "metrics.jsonl").read_text().splitlines()]
        late = [m["stare/entropy"] for m in metrics[-1:]]  # 4 steps: ceil(25% of 4) = 1
        assert float(rows[arm]["late_entropy_mean"]) == pytest.approx(sum(late) / len(late))
        ev = json.loads((out / arm / "eval.json").read_text())
        assert float(rows[arm]["avg_at_8_mean"]) == ev["avg_at_k"] == ev["avg_at_8"]


def test_folder_of_runs_expands(tmp_path):
    make_run(tmp_path / "demo" / "grpo", "grpo", [0.5] * 4)
    make_run(tmp_path / "demo" / "dapo", "dapo", [0.5] * 4)
    rows = compare([tmp_path / "demo"], tmp_path / "out")
    assert [r["arm"] for r in rows] == ["grpo", "dapo"]  # the registry order, whatever the folder order


def test_bad_input_exit_2(tmp_path):
    (tmp_path / "empty").mkdir()
    res = subprocess.run([sys.executable, "-m", "stare.cli.main", "compare", str(tmp_path / "empty"), "--out",
                          str(tmp_path / "o")], capture_output=True, text=True)
    assert res.returncode == 2 and "holds no training run" in res.stderr and "Traceback" not in res.stderr
    assert len([x for x in res.stderr.splitlines() if x.strip()]) == 1


def _seeded_runs(root, algo, lates):
    """One run folder per seed under ``root``/``algo``, each ending at its late entropy."""
    paths = []
    for seed, h in enumerate(lates):
        path = root / algo / f"seed{seed}"
        make_run(path, algo, [0.8] * 15 + [h] * 5)
        cfg = yaml.safe_load((path / "config.yaml").read_text())
        cfg["settings"]["seed"] = seed
        (path / "config.yaml").write_text(yaml.safe_dump(cfg))
        paths.append(path)
    return paths


def test_seed_table_intervals_and_permutation_tests(tmp_path):
    """Three seeds per arm: the late-entropy 95% interval against statistics.stdev and Student's t (4.303 for two
    degrees of freedom), and the exact permutation p-values counted by hand (20 splits of six values)."""
    import statistics

    late = {"dapo": [0.10, 0.12, 0.14], "stare-phi": [0.35, 0.40, 0.38]}
    runs = [path for algo, values in late.items() for path in _seeded_runs(tmp_path, algo, values)]
    compare(runs, tmp_path / "cmp")
    summary = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    rows = {r["label"]: r for r in summary["seed_tests"]}
    phi = rows["stare-phi"]["late_entropy"]
    v = late["stare-phi"]
    half = 4.303 * statistics.stdev(v) / math.sqrt(3)
    assert phi["ci95"] == pytest.approx([statistics.mean(v) - half, statistics.mean(v) + half], rel=1e-6)
    # every stare-phi value is above every dapo value: only the observed split of the 20 reaches its sum
    assert phi["p_higher"] == pytest.approx(1 / 20) and phi["p_lower"] == 1.0
    assert rows["dapo"]["late_entropy"]["p_higher"] is None  # the baseline is not tested against itself
    md = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "| stare-phi | 3 |" in md and "p late H > dapo" in md and "0.050" in md


def test_seed_table_p_values_below_a_thousandth_keep_their_digits():
    from stare.cli.report.tables import _fmt_p

    assert _fmt_p(1 / 12870) == "7.8e-05" and _fmt_p(0.05) == "0.050" and _fmt_p(None) == ""


def test_baseline_picks_one_of_two_arms_of_an_algorithm_by_folder(tmp_path):
    """``--baseline FOLDER`` tests every arm against that arm (here a second stare arm, the gate-off control), and
    the p-values are those of a brute-force count over the 20 ways to split six per-seed values 3 + 3."""
    import itertools

    gate_on, gate_off, dapo = [0.25, 0.27, 0.20], [0.15, 0.26, 0.24], [0.10, 0.12, 0.14]
    _seeded_runs(tmp_path / "on", "stare", gate_on)
    _seeded_runs(tmp_path / "off", "stare", gate_off)
    _seeded_runs(tmp_path / "on", "dapo", dapo)
    res = stare("compare", str(tmp_path / "on"), str(tmp_path / "off"), "--out", str(tmp_path / "cmp"),
                "--baseline", str(tmp_path / "off" / "stare"))
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    rows = {r["label"]: r for r in summary["seed_tests"]}
    on_label, off_label = f"stare ({tmp_path / 'on' / 'stare'})", f"stare ({tmp_path / 'off' / 'stare'})"

    def p_higher(x, y):  # share of the splits whose first half's sum reaches the observed one
        pool, observed = x + y, sum(x)
        splits = list(itertools.combinations(range(6), 3))
        return sum(sum(pool[i] for i in s) >= observed - 1e-12 for s in splits) / len(splits)

    assert rows[on_label]["late_entropy"]["p_higher"] == pytest.approx(p_higher(gate_on, gate_off))
    assert rows[on_label]["late_entropy"]["p_lower"] == pytest.approx(p_higher(gate_off, gate_on))
    assert rows["dapo"]["late_entropy"]["p_lower"] == pytest.approx(p_higher(gate_off, dapo)) == pytest.approx(0.05)
    assert rows[off_label]["late_entropy"]["p_higher"] is None  # the baseline itself
    # the label as printed and the algorithm name pick arms too (the algorithm: its first arm, here the gate-on one)
    from stare.cli.report.seeds import find_baseline

    arms = [{"arm": "stare", "label": on_label}, {"arm": "stare", "label": off_label}, {"arm": "dapo", "label": "dapo"}]
    assert find_baseline(arms, off_label) is arms[1] and find_baseline(arms, "stare") is arms[0]
    assert find_baseline(arms, "grpo") is None


def test_baseline_names_the_folder_of_an_algorithms_only_arm(tmp_path):
    """``--baseline FOLDER`` where the arm's label carries no folder (its algorithm has one arm here): the folder of
    its seeds, or one seed's run folder, picks it; the tests are then against it (brute force over the 20 splits)."""
    import itertools

    grpo, twin = [0.30, 0.41, 0.35], [0.20, 0.22, 0.45]
    _seeded_runs(tmp_path / "main", "grpo", grpo)
    _seeded_runs(tmp_path / "twin", "dapo", twin)
    pool, splits = grpo + twin, list(itertools.combinations(range(6), 3))
    expect = sum(sum(pool[i] for i in s) >= sum(grpo) - 1e-12 for s in splits) / len(splits)
    for baseline in (tmp_path / "twin" / "dapo", tmp_path / "twin" / "dapo" / "seed0"):
        res = stare("compare", str(tmp_path / "main"), str(tmp_path / "twin"), "--out", str(tmp_path / "cmp"),
                    "--baseline", str(baseline))
        assert res.returncode == 0, res.stderr[-3000:]
        rows = {r["label"]: r for r in json.loads((tmp_path / "cmp" / "comparison.json").read_text())["seed_tests"]}
        assert rows["dapo"]["late_entropy"]["p_higher"] is None  # the baseline itself
        assert rows["grpo"]["late_entropy"]["p_higher"] == pytest.approx(expect)
    from stare.cli.report.seeds import find_baseline

    arm = {"arm": "dapo", "label": "dapo", "runs": [{"path": str(tmp_path / "twin" / "dapo" / f"seed{i}")}
                                                    for i in range(3)]}
    assert find_baseline([arm], str(tmp_path / "twin")) is None  # the run set's folder is not the arm's


def test_a_baseline_that_names_no_arm_is_one_line_and_writes_nothing(tmp_path):
    _seeded_runs(tmp_path / "runs", "dapo", [0.1, 0.2])
    res = stare("compare", str(tmp_path / "runs"), "--out", str(tmp_path / "cmp"), "--baseline", "grpo")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "--baseline 'grpo'" in lines[0] and "the arms are: dapo" in lines[0]
    assert not (tmp_path / "cmp").exists()


# issue 58 item 6: a baseline without dapo, intervals inside the measure's range, a warning for unlike runs

def _brute_p_higher(x, y):
    """One-sided exact permutation p: the share of the splits of x + y whose first len(x) values sum to at least
    x's sum."""
    import itertools

    pool, observed = x + y, sum(x)
    splits = list(itertools.combinations(range(len(pool)), len(x)))
    return sum(sum(pool[i] for i in s) >= observed - 1e-12 for s in splits) / len(splits)


@pytest.mark.parametrize("arms, baseline", [({"grpo": [0.10, 0.12, 0.14], "stare-phi": [0.35, 0.40, 0.38]}, "grpo"),
                                            ({"stare-phi": [0.35, 0.40, 0.38], "stare": [0.10, 0.12, 0.14]}, "stare")])
def test_without_a_dapo_arm_the_tests_use_grpo_else_the_first_arm_and_say_so(tmp_path, arms, baseline):
    """`--algos grpo,stare-phi`: the p columns were blank with no note. grpo when there is one, else the first arm in
    the registry's order (stare before stare-phi); the p-values against a brute-force count."""
    for algo, values in arms.items():
        _seeded_runs(tmp_path, algo, values)
    res = stare("compare", str(tmp_path / "grpo" if "grpo" in arms else tmp_path / "stare"),
                str(tmp_path / "stare-phi"), "--out", str(tmp_path / "cmp"))
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert summary["baseline"] == baseline
    rows = {r["label"]: r for r in summary["seed_tests"]}
    assert rows["stare-phi"]["late_entropy"]["p_higher"] == pytest.approx(
        _brute_p_higher(arms["stare-phi"], arms[baseline])) == pytest.approx(1 / 20)
    assert rows[baseline]["late_entropy"]["p_higher"] is None
    md = (tmp_path / "cmp" / "comparison.md").read_text()
    assert f"p late H > {baseline}" in md and "| 0.050 |" in md
    assert f"- Baseline of the tests: {baseline} (there is no dapo arm; --baseline names another)." in md
    # with dapo there, dapo it is, and no such note
    _seeded_runs(tmp_path, "dapo", [0.2, 0.21, 0.22])
    compare([tmp_path], tmp_path / "cmp2")
    assert json.loads((tmp_path / "cmp2" / "comparison.json").read_text())["baseline"] == "dapo"
    assert "Baseline of the tests" not in (tmp_path / "cmp2" / "comparison.md").read_text()


def test_seed_intervals_stay_inside_the_measures_range(tmp_path):
    """A late entropy near 0 and a band share near 1 over three seeds: the t interval (4.303 s / sqrt 3 about the
    mean, computed here) crosses 0 and 1; the table's is clipped to [0, inf) and [0, 1]."""
    import statistics

    late = [0.0, 0.01, 0.12]  # the last 25% of 20 steps: steps 16-20
    for seed, h in enumerate(late):
        path = tmp_path / "grpo" / f"seed{seed}"
        make_run(path, "grpo", [0.8] * 15 + [h] * 5)
        cfg = yaml.safe_load((path / "config.yaml").read_text())
        cfg["settings"]["seed"] = seed
        (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    band = [1.0, 1.0, 0.6]  # in the band [0.3, 0.45] at 5, 5 and 3 of the last 5 steps
    for seed, share in enumerate(band):
        inside = round(share * 5)
        path = tmp_path / "stare-phi" / f"seed{seed}"
        make_run(path, "stare-phi", [0.8] * 15 + [0.4] * inside + [0.9] * (5 - inside))
        cfg = yaml.safe_load((path / "config.yaml").read_text())
        cfg["settings"]["seed"] = seed
        (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    compare([tmp_path / "grpo", tmp_path / "stare-phi"], tmp_path / "cmp")
    summary = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    rows = {r["label"]: r for r in summary["seed_tests"]}

    def t(values):
        half = 4.303 * statistics.stdev(values) / math.sqrt(3)
        return statistics.mean(values) - half, statistics.mean(values) + half

    lo, hi = t(late)
    assert lo < 0 and rows["grpo"]["late_entropy"]["ci95"] == pytest.approx([0.0, hi], rel=1e-6)
    lo, hi = t(band)
    assert hi > 1 and rows["stare-phi"]["band_share"]["ci95"] == pytest.approx([lo, 1.0], rel=1e-6)
    md = (tmp_path / "cmp" / "comparison.md").read_text()
    assert f"[0.000, {t(late)[1]:.3f}]" in md and "clipped to the measure's range" in md


def test_t_interval_bounds_by_hand():
    from stare.cli.report.seeds import measure_range, t_interval

    assert t_interval([0.9, 1.0], measure_range("avg_at_k")) == pytest.approx(
        (0.95 - 12.706 * math.sqrt(0.005) / math.sqrt(2), 1.0))
    assert measure_range("aime25_avg_at_k") == (0.0, 1.0) and measure_range("final_reward") == (None, None)
    assert t_interval([0.9, 1.0])[1] > 1  # no bounds: the plain t interval


def test_runs_that_differ_in_steps_or_settings_are_compared_with_a_warning(tmp_path):
    """A 200-step arm and an 80-step arm were p-tested together with no word; now a warning on stderr and in the
    notes names the keys and values. Runs that differ only in algorithm and seed get none."""
    for algo, steps in (("dapo", 200), ("stare-phi", 80)):
        for seed in range(2):
            path = tmp_path / algo / f"seed{seed}"
            make_run(path, algo, [0.5] * 20)
            cfg = yaml.safe_load((path / "config.yaml").read_text())
            cfg["settings"].update({"seed": seed, "steps": steps, "lr": 1e-3})
            (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    res = stare("compare", str(tmp_path / "dapo"), str(tmp_path / "stare-phi"), "--out", str(tmp_path / "cmp"))
    assert res.returncode == 0, res.stderr[-3000:]
    want = ("the compared runs differ in more than algorithm and seed (steps 200, 80): their intervals and "
            "p-values set runs trained differently side by side")
    assert [x for x in res.stderr.splitlines() if x.strip()] == [f"warning: {want}"]
    assert f"- Warning: {want}." in (tmp_path / "cmp" / "comparison.md").read_text()
    assert json.loads((tmp_path / "cmp" / "comparison.json").read_text())["warnings"] == [want]
    # the same steps: no warning
    for seed in range(2):
        cfg_path = tmp_path / "stare-phi" / f"seed{seed}" / "config.yaml"
        cfg = yaml.safe_load(cfg_path.read_text())
        cfg["settings"]["steps"] = 200
        cfg_path.write_text(yaml.safe_dump(cfg))
    res = stare("compare", str(tmp_path / "dapo"), str(tmp_path / "stare-phi"), "--out", str(tmp_path / "cmp2"))
    assert res.returncode == 0 and "warning" not in res.stderr, res.stderr
    assert json.loads((tmp_path / "cmp2" / "comparison.json").read_text())["warnings"] == []
