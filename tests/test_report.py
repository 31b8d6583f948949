"""The local comparison report: numbers checked against hand computations on hand-written run directories."""
import csv
import json
import math

import pytest
import yaml

from stare.cli.report.plots import plot_curves
from stare.cli.report.runs import load_run, summarise_arm
from stare.cli.report.tables import write_comparison
from stare.eval.metrics import permutation_test

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_run(root, name, algo, seed, *, rewards, entropies, lengths=None, eval_=None, band=(0.3, 0.45),
             extra=None, k=8):
    """A run directory with one metrics line per step (step i+1 gets rewards[i], entropies[i], ...)."""
    run = root / name
    run.mkdir(parents=True)
    config = {"preset": "tiny-cpu", "backend": "local",
              "algo": {"name": algo, "stare": algo.startswith("stare"), "controller": "band",
                       "target_entropy": 0.3, "band_low": band[0], "band_high": band[1]},
              "settings": {"seed": seed, "steps": len(rewards), "task": "reverse", "eval_k": k}}
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    lines = []
    for i, (r, h) in enumerate(zip(rewards, entropies)):
        rec = {"step": i + 1, "reward_mean": r, "entropy": h,
               "response_length": (lengths[i] if lengths else 8.0)}
        rec.update((extra or {}).get(i + 1, {}))
        rec = {key: v for key, v in rec.items() if v is not None}  # None: the key is left out of the line
        lines.append(json.dumps(rec))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if eval_ is not None:
        (run / "eval.json").write_text(json.dumps({"k": k, "algo": algo, "steps": len(rewards), **eval_}))
    return run


def held_out(avg, pas, greedy, hard=None, warmstart=None, k=8):
    out = {f"avg_at_{k}": avg, f"pass_at_{k}": pas, "greedy_accuracy": greedy, "n_problems": 200,
           "warmstart": warmstart}
    if hard is not None:
        out["hard"] = {f"avg_at_{k}": hard[0], f"pass_at_{k}": hard[1], "greedy_accuracy": 0.0, "n_problems": 50}
    return out


def read_csv(path):
    with open(path, newline="") as f:
        return {row["arm"]: row for row in csv.DictReader(f)}


# 20 steps: final window = 2 steps (19, 20), late window = 5 steps (16..20), slope window = 10 steps (11..20)
LINEAR_REWARDS = [0.2 + 0.001 * s for s in range(1, 21)]
ENTROPIES = [0.8] + [0.6] * 14 + [0.2, 0.35, 0.4, 0.45, 0.5]


def test_single_run_measures_by_hand(tmp_path):
    run = make_run(tmp_path, "grpo", "grpo", 0, rewards=LINEAR_REWARDS, entropies=ENTROPIES,
                   eval_=held_out(0.7, 0.9, 0.65))
    summary = write_comparison(tmp_path / "out", [load_run(run)])
    m = summary["arms"][0]["metrics"]
    late = (0.2 + 0.35 + 0.4 + 0.45 + 0.5) / 5
    assert m["final_reward"]["mean"] == pytest.approx((LINEAR_REWARDS[18] + LINEAR_REWARDS[19]) / 2)
    assert m["late_reward_slope"]["mean"] == pytest.approx(0.1)  # 0.001 per step = 0.1 per 100 steps
    assert m["start_entropy"]["mean"] == pytest.approx(0.8)
    assert m["late_entropy"]["mean"] == pytest.approx(late)
    assert m["late_start_ratio"]["mean"] == pytest.approx(late / 0.8)
    assert m["band_share"]["mean"] == pytest.approx(3 / 5)  # 0.35, 0.4, 0.45 (edges count)
    assert m["avg_at_k"]["mean"] == 0.7 and m["pass_at_k"]["mean"] == 0.9 and m["greedy_accuracy"]["mean"] == 0.65
    assert m["final_reward"]["std"] is None and m["final_reward"]["n"] == 1  # one seed: no std
    assert summary["k"] == 8 and summary["band"] == [0.3, 0.45] and summary["steps"] == 20

    row = read_csv(tmp_path / "out" / "comparison.csv")["grpo"]
    assert row["seeds"] == "1"
    assert float(row["final_reward_mean"]) == pytest.approx(0.2195)
    assert float(row["late_reward_slope_per_100_mean"]) == pytest.approx(0.1)
    assert float(row["band_share_mean"]) == pytest.approx(0.6)
    assert float(row["avg_at_8_mean"]) == 0.7 and float(row["pass_at_8_mean"]) == 0.9
    assert row["final_reward_std"] == "" and row["avg_at_8_std"] == ""
    assert "hard_pass_at_8_mean" not in row  # no hard cases in eval.json: no hard columns

    md = (tmp_path / "out" / "comparison.md").read_text()
    assert "preset tiny-cpu, task reverse, 20 steps, 1 seed(s) per arm, held-out k = 8" in md
    assert "[0.30, 0.45]" in md and "avg@8" in md and "| grpo | 1 | 0.220 | 0.700 | 0.900 |" in md
    assert json.loads((tmp_path / "out" / "comparison.json").read_text()) == summary


def test_missing_keys_are_absent_not_zero(tmp_path):
    # step 20 skipped without reward_mean or entropy; step 1 has no response_length
    run = make_run(tmp_path, "dapo", "dapo", 0, rewards=LINEAR_REWARDS[:19] + [None],
                   entropies=ENTROPIES[:19] + [None], extra={20: {"skipped": True}, 1: {"response_length": None}})
    m = summarise_arm([load_run(run)])["metrics"]
    assert m["final_reward"]["mean"] == pytest.approx(LINEAR_REWARDS[18])  # the window's one logged reward
    assert m["late_entropy"]["mean"] == pytest.approx((0.2 + 0.35 + 0.4 + 0.45) / 4)
    assert m["band_share"]["mean"] == pytest.approx(3 / 4)
    assert m["late_reward_slope"]["mean"] == pytest.approx(0.1)
    for name in ("avg_at_k", "pass_at_k", "greedy_accuracy", "hard_pass_at_k"):
        assert m[name] == {"mean": None, "std": None, "n": 0}


def test_missing_eval_gives_blanks_and_a_note(tmp_path):
    a = make_run(tmp_path, "grpo", "grpo", 0, rewards=LINEAR_REWARDS, entropies=ENTROPIES,
                 eval_=held_out(0.7, 0.9, 0.65))
    b = make_run(tmp_path, "dapo", "dapo", 0, rewards=LINEAR_REWARDS[:12], entropies=ENTROPIES[:12])
    cfg = yaml.safe_load((b / "config.yaml").read_text())
    cfg["settings"]["steps"] = 20  # interrupted at step 12 of 20
    (b / "config.yaml").write_text(yaml.safe_dump(cfg))
    summary = write_comparison(tmp_path / "out", [load_run(a), load_run(b)])
    rows = read_csv(tmp_path / "out" / "comparison.csv")
    assert list(rows) == ["grpo", "dapo"]  # the registry's order
    assert rows["dapo"]["avg_at_8_mean"] == "" and rows["dapo"]["pass_at_8_mean"] == ""
    assert rows["dapo"]["greedy_accuracy_mean"] == ""
    assert rows["dapo"]["final_reward_mean"] != ""  # the training curve is still there
    dapo = summary["arms"][1]
    assert dapo["metrics"]["avg_at_k"]["mean"] is None and dapo["runs"][0]["has_eval"] is False
    md = (tmp_path / "out" / "comparison.md").read_text()
    assert "no eval.json" in md and "stopped at step 12 of 20" in md
    assert "| dapo | 1 | " in md and "warm start" not in md
    # no eval.json at all: k for the column names comes from the config's eval_k
    write_comparison(tmp_path / "only-dapo", [load_run(b)])
    assert read_csv(tmp_path / "only-dapo" / "comparison.csv")["dapo"]["avg_at_8_mean"] == ""


def test_two_seeds_mean_std_and_warmstart_row(tmp_path):
    ws0 = {"k": 8, "avg_at_8": 0.4, "pass_at_8": 0.7, "greedy_accuracy": 0.5}
    ws1 = {"k": 8, "avg_at_8": 0.5, "pass_at_8": 0.8, "greedy_accuracy": 0.6}
    runs = [
        make_run(tmp_path, "s0", "stare-phi", 0, rewards=[0.5] * 20, entropies=ENTROPIES,
                 eval_=held_out(0.8, 0.9, 0.7, warmstart=ws0)),
        make_run(tmp_path, "s1", "stare-phi", 1, rewards=[0.7] * 20, entropies=ENTROPIES,
                 eval_=held_out(0.9, 1.0, 0.8, warmstart=ws1)),
    ]
    summary = write_comparison(tmp_path / "out", [load_run(r) for r in runs])
    std = math.sqrt(2 * 0.05 ** 2)  # sample std of two values 0.1 apart
    m = summary["arms"][0]["metrics"]
    assert summary["arms"][0]["n_seeds"] == 2 and summary["arms"][0]["seeds"] == [0, 1]
    assert m["avg_at_k"]["mean"] == pytest.approx(0.85) and m["avg_at_k"]["std"] == pytest.approx(std)
    assert m["final_reward"]["mean"] == pytest.approx(0.6) and m["final_reward"]["std"] == pytest.approx(
        math.sqrt(2 * 0.1 ** 2))
    assert m["late_reward_slope"]["mean"] == pytest.approx(0.0)
    rows = read_csv(tmp_path / "out" / "comparison.csv")
    assert float(rows["stare-phi"]["pass_at_8_mean"]) == pytest.approx(0.95)
    assert float(rows["stare-phi"]["pass_at_8_std"]) == pytest.approx(std)
    assert float(rows["warmstart"]["avg_at_8_mean"]) == pytest.approx(0.45)  # one warm start per seed
    assert rows["warmstart"]["final_reward_mean"] == ""
    md = (tmp_path / "out" / "comparison.md").read_text()
    assert "0.850 ± 0.071" in md and "0.950 ± 0.071" in md
    assert "| warm start (before RL) | 2 |  | 0.450 ± 0.071 | 0.750 ± 0.071 | 0.550 ± 0.071 |" in md
    assert md.index("warm start") < md.index("| stare-phi |")


def test_hard_cases_and_permutation_p_value_vs_baseline(tmp_path):
    runs = []
    for seed, (hp_stare, hp_dapo) in enumerate([(0.9, 0.5), (0.95, 0.6), (1.0, 0.7)]):
        runs.append(make_run(tmp_path, f"dapo{seed}", "dapo", seed, rewards=LINEAR_REWARDS, entropies=ENTROPIES,
                             eval_=held_out(0.6, 0.8, 0.6, hard=(0.3, hp_dapo))))
        runs.append(make_run(tmp_path, f"stare{seed}", "stare-phi", seed, rewards=LINEAR_REWARDS,
                             entropies=ENTROPIES, eval_=held_out(0.7, 0.9, 0.6, hard=(0.5, hp_stare))))
    one_seed = make_run(tmp_path, "grpo", "grpo", 0, rewards=LINEAR_REWARDS, entropies=ENTROPIES,
                        eval_=held_out(0.5, 0.7, 0.5, hard=(0.1, 0.2)))
    summary = write_comparison(tmp_path / "out", [load_run(r) for r in runs + [one_seed]])
    arms = {a["arm"]: a for a in summary["arms"]}
    assert list(arms) == ["grpo", "dapo", "stare-phi"]  # the registry's order, not the order given
    # stare's three values are the three largest of six: 1 split out of C(6, 3) = 20
    assert arms["stare-phi"]["p_hard_pass_vs_baseline"] == pytest.approx(1 / 20)
    assert arms["dapo"]["p_hard_pass_vs_baseline"] is None  # the baseline itself
    assert arms["grpo"]["p_hard_pass_vs_baseline"] is None  # one seed: not tested
    assert arms["stare-phi"]["metrics"]["hard_pass_at_k"]["mean"] == pytest.approx(0.95)
    rows = read_csv(tmp_path / "out" / "comparison.csv")
    assert float(rows["stare-phi"]["p_hard_pass_at_8_vs_dapo"]) == pytest.approx(0.05)
    assert rows["dapo"]["p_hard_pass_at_8_vs_dapo"] == "" and rows["grpo"]["p_hard_pass_at_8_vs_dapo"] == ""
    assert float(rows["dapo"]["hard_avg_at_8_mean"]) == pytest.approx(0.3)
    md = (tmp_path / "out" / "comparison.md").read_text()
    assert "one-sided exact permutation test on per-seed hard-case pass@k vs dapo" in md
    assert "hard pass@8" in md and "p hard pass@8 vs dapo" in md
    assert summary["test"] == "one-sided exact permutation test on per-seed hard-case pass@k vs dapo"


def test_permutation_test_exact_cases_by_hand():
    # pool {1,2,3,4}, 6 splits of two; only {3,4} reaches the observed sum 7
    assert permutation_test([3, 4], [1, 2]) == pytest.approx(1 / 6)
    assert permutation_test([1, 2], [3, 4]) == pytest.approx(1.0)
    assert permutation_test([1, 1], [1, 1]) == pytest.approx(1.0)  # ties count as reaching the observed sum
    # pool {1,...,5}, sum(a) = 10: a triple reaches 10 iff its complementary pair sums to <= 5:
    # {1,2}, {1,3}, {1,4}, {2,3} -> 4 of C(5, 3) = 10
    assert permutation_test([2, 3, 5], [1, 4]) == pytest.approx(0.4)
    assert permutation_test([0.1 + 0.2, 0.5], [0.3, 0.1]) == pytest.approx(2 / 6)  # {0.3,0.5} twice: float ties
    with pytest.raises(ValueError):
        permutation_test([], [1.0])


def test_permutation_test_sampled_beyond_the_exact_limit():
    import itertools

    a = [0.9, 1.1, 1.3, 0.7, 1.0, 1.2, 0.8, 1.4, 0.6, 1.5]
    b = [0.5, 1.0, 0.4, 0.9, 0.3, 1.2, 0.2, 0.8, 0.7, 0.6, 1.1]
    assert math.comb(21, 10) > 200_000  # sampled, not enumerated
    pool = a + b
    exact = sum(sum(pool[i] for i in idx) >= sum(a) - 1e-9
                for idx in itertools.combinations(range(21), 10)) / math.comb(21, 10)
    p = permutation_test(a, b)
    assert p == permutation_test(a, b)  # fixed seed
    assert abs(p - exact) < 0.005


def test_load_run_errors_name_the_file(tmp_path):
    run = make_run(tmp_path, "r", "grpo", 0, rewards=[0.5, 0.6], entropies=[0.4, 0.4])
    assert load_run(run).algo == "grpo" and load_run(run).seed == 0 and load_run(run).eval is None

    with pytest.raises(ValueError, match="no config.yaml"):
        load_run(tmp_path / "nowhere")
    (run / "metrics.jsonl").rename(run / "m.bak")
    with pytest.raises(ValueError, match=r"r: no metrics.jsonl"):
        load_run(run)
    (run / "m.bak").rename(run / "metrics.jsonl")

    good = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\nnot json\n' + good)
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2 is not valid JSON"):
        load_run(run)
    (run / "metrics.jsonl").write_text('{"reward_mean": 0.5}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl line 1 is malformed"):
        load_run(run)
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"metrics.jsonl holds no steps"):
        load_run(run)
    # a run killed while writing its last line: the partial line is dropped, with a warning the comparison says
    (run / "metrics.jsonl").write_text(good + '{"step": 3, "rew')
    cut = load_run(run)
    assert [r["step"] for r in cut.metrics] == [1, 2]
    assert cut.warnings == [f"{run / 'metrics.jsonl'}: its last line (3) was cut off while it was written (the run "
                            "was stopped); it is left out"]
    from typer.testing import CliRunner

    from stare.cli.main import app

    res = CliRunner().invoke(app, ["compare", str(run), "--out", str(tmp_path / "cmp")], terminal_width=300)
    assert res.exit_code == 0, res.output
    said = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert said == [f"warning: {cut.warnings[0]}"], res.stderr  # one line, no Python warning with a source path
    assert "cut off" in (tmp_path / "cmp" / "comparison.md").read_text()
    (run / "metrics.jsonl").write_text(good)
    assert load_run(run).warnings == []

    (run / "config.yaml").write_text("algo: [unclosed\n")
    with pytest.raises(ValueError, match=r"config.yaml is not valid YAML"):
        load_run(run)
    (run / "config.yaml").write_text("preset: tiny-cpu\nalgo: {stare: false}\n")
    with pytest.raises(ValueError, match=r"config.yaml is malformed"):
        load_run(run)


def test_different_k_is_refused(tmp_path):
    a = make_run(tmp_path, "a", "grpo", 0, rewards=[0.5] * 4, entropies=[0.4] * 4, eval_=held_out(0.5, 0.6, 0.5))
    b = make_run(tmp_path, "b", "dapo", 0, rewards=[0.5] * 4, entropies=[0.4] * 4,
                 eval_=held_out(0.5, 0.6, 0.5, k=16), k=16)
    with pytest.raises(ValueError, match="different k"):
        write_comparison(tmp_path / "out", [load_run(a), load_run(b)])


def test_plots_are_png_files(tmp_path):
    runs = []
    for seed in range(2):
        for algo, drift in (("grpo", -0.02), ("stare-phi", 0.0)):
            steps = range(1, 41)
            runs.append(make_run(
                tmp_path, f"{algo}-{seed}", algo, seed,
                rewards=[min(1.0, 0.3 + 0.015 * s + 0.05 * ((s * (seed + 3)) % 5) / 5) for s in steps],
                entropies=[max(0.05, 0.6 + drift * s + 0.04 * ((s * (seed + 2)) % 4) / 4) for s in steps],
                lengths=[8 + (s % 3) * 0.3 + seed * 0.2 for s in steps]))
    written = plot_curves(tmp_path / "plots", [load_run(r) for r in runs])
    assert [p.name for p in written] == ["entropy.png", "reward.png", "response_length.png"]
    for p in written:
        data = p.read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 10_000


def test_eval_json_field_names_old_and_new():
    """eval.json's avg_at_k/pass_at_k (the names summary.json uses) are read, and so are the older avg_at_8/pass_at_8."""
    from stare.cli.report.runs import held_out

    assert held_out({"avg_at_k": 0.5, "pass_at_k": 0.75, "greedy_accuracy": 0.25}, 8) == \
        {"avg_at_k": 0.5, "pass_at_k": 0.75, "greedy_accuracy": 0.25}
    assert held_out({"avg_at_8": 0.5, "pass_at_8": 0.75}, 8) == {"avg_at_k": 0.5, "pass_at_k": 0.75,
                                                                 "greedy_accuracy": None}
    assert held_out({"avg_at_16": 0.5}, 8)["avg_at_k"] is None  # another k's field is not this k's


# ---- the selection telemetry table ------------------------------------------------------------------------------
def telemetry_table(md):
    """comparison.md's "Selection telemetry" table: arm label -> {header: cell}."""
    lines = md.splitlines()
    start = lines.index("## Selection telemetry") + 2
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def test_selection_telemetry_by_hand(tmp_path):
    rewards, ents = [0.5] * 4, [0.6] * 4
    # stare seed 0: new names; step 2 (gate off) logs no boosted/lowered share, step 3 no lowered share
    s0 = {1: {"stare/gate_on": 1, "stare/mean_weight": 1.2, "stare/boosted_phi_pos_share": 0.5,
              "stare/lowered_phi_pos_share": 0.25, "stare/masked_share": 0.0, "stare/entropy_forecast": 1e-3,
              "stare/entropy_forecast_base": -2e-3},
          2: {"stare/gate_on": 0, "stare/mean_weight": 1.0, "stare/masked_share": 0.0,
              "stare/entropy_forecast": -1e-3, "stare/entropy_forecast_base": -1e-3},
          3: {"stare/gate_on": 1, "stare/mean_weight": 1.1, "stare/boosted_phi_pos_share": 0.75,
              "stare/masked_share": 0.0, "stare/entropy_forecast": 2e-3, "stare/entropy_forecast_base": -3e-3},
          4: {"stare/gate_on": 1, "stare/mean_weight": 1.3, "stare/boosted_phi_pos_share": 0.25,
              "stare/lowered_phi_pos_share": 0.5, "stare/masked_share": 0.0, "stare/entropy_forecast": 2e-3,
              "stare/entropy_forecast_base": -2e-3}}
    # stare seed 1: an old run (stare/boosted_raise_share), no lowered share, no forecasts, gate off twice
    s1 = {1: {"stare/gate_on": 0, "stare/mean_weight": 1.0},
          2: {"stare/gate_on": 1, "stare/mean_weight": 1.4, "stare/boosted_raise_share": 0.2},
          3: {"stare/gate_on": 1, "stare/mean_weight": 1.2, "stare/boosted_raise_share": 0.4},
          4: {"stare/gate_on": 0, "stare/mean_weight": 1.0}}
    # an 80-20 arm (one seed) masking tokens; a dapo arm that logged none of the telemetry
    m = {i: {"stare/masked_share": v, "stare/mean_weight": 1 - v} for i, v in zip(range(1, 5), (0.8, 0.8, 0.7, 0.9))}
    runs = [load_run(make_run(tmp_path, "s0", "stare", 0, rewards=rewards, entropies=ents, extra=s0)),
            load_run(make_run(tmp_path, "s1", "stare", 1, rewards=rewards, entropies=ents, extra=s1)),
            load_run(make_run(tmp_path, "m", "80-20", 0, rewards=rewards, entropies=ents, extra=m)),
            load_run(make_run(tmp_path, "d", "dapo", 0, rewards=rewards, entropies=ents))]
    summary = write_comparison(tmp_path / "out", runs)
    arms = {a["arm"]: a["telemetry"] for a in summary["arms"]}

    def mean_std(a, b):  # two seeds: mean and sample std by hand
        mu = (a + b) / 2
        return mu, math.sqrt((a - mu) ** 2 + (b - mu) ** 2)

    expect = {  # per-seed step means written out by hand
        "gate_on_share": mean_std(3 / 4, 2 / 4),
        "mean_weight": mean_std((1.2 + 1.0 + 1.1 + 1.3) / 4, (1.0 + 1.4 + 1.2 + 1.0) / 4),
        "boosted_phi_pos_share": mean_std((0.5 + 0.75 + 0.25) / 3, (0.2 + 0.4) / 2),  # the legacy name counts
    }
    t = arms["stare"]
    for name, (mu, sd) in expect.items():
        assert t[name]["mean"] == pytest.approx(mu) and t[name]["std"] == pytest.approx(sd) and t[name]["n"] == 2
    # logged by one seed only: its mean, no std, n = 1
    assert t["lowered_phi_pos_share"] == {"mean": pytest.approx((0.25 + 0.5) / 2), "std": None, "n": 1}
    assert t["entropy_forecast"] == {"mean": pytest.approx(1e-3), "std": None, "n": 1}  # (1 - 1 + 2 + 2) / 4 x 1e-3
    assert t["entropy_forecast_base"] == {"mean": pytest.approx(-2e-3), "std": None, "n": 1}
    assert t["masked_share"] == {"mean": 0.0, "std": None, "n": 1}  # logged as 0: 0, not blank
    assert t["penalised_share"] == {"mean": None, "std": None, "n": 0}  # never logged: None, never 0
    assert arms["80-20"]["masked_share"]["mean"] == pytest.approx(0.8)
    assert arms["80-20"]["gate_on_share"]["mean"] is None
    assert all(agg["n"] == 0 for agg in arms["dapo"].values())
    written = {a["arm"]: a for a in json.loads((tmp_path / "out" / "comparison.json").read_text())["arms"]}
    assert written["stare"]["telemetry"]["boosted_phi_pos_share"]["std"] == pytest.approx(math.sqrt(0.02))
    assert [r["telemetry"]["boosted_phi_pos_share"] for r in written["stare"]["runs"]] == pytest.approx([0.5, 0.3])
    assert written["dapo"]["telemetry"]["masked_share"] == {"mean": None, "std": None, "n": 0}

    rows = telemetry_table((tmp_path / "out" / "comparison.md").read_text())
    mu, sd = expect["boosted_phi_pos_share"]
    assert rows["stare"]["seeds"] == "2"
    assert rows["stare"]["boosted Phi>0"] == f"{mu:.3f} ± {sd:.3f}" == "0.400 ± 0.141"
    assert rows["stare"]["gate on"] == "0.625 ± 0.177"
    assert rows["stare"]["lowered Phi>0"] == "0.375 (n=1)"
    assert rows["stare"]["forecast"] == "+1.00e-03 (n=1)" and rows["stare"]["forecast unweighted"] == "-2.00e-03 (n=1)"
    assert rows["stare"]["masked"] == "0.000 (n=1)" and rows["stare"]["penalised"] == ""
    assert rows["80-20"]["masked"] == "0.800" and rows["80-20"]["gate on"] == ""
    assert set(rows["dapo"].values()) == {"dapo", "1", ""}
    assert list(rows) == [a["label"] for a in summary["arms"]]  # one row per arm, in the main table's order


def test_main_table_unchanged_without_telemetry(tmp_path):
    """A run without the telemetry gets no telemetry section; with it, the part before the section is the same file."""
    rewards = LINEAR_REWARDS
    extra = {s: {"stare/gate_on": s % 2, "stare/mean_weight": 1.1} for s in range(1, 21)}
    ev = held_out(0.7, 0.9, 0.65)  # with eval.json: no note naming the (different) folders
    plain = make_run(tmp_path / "a", "stare", "stare", 0, rewards=rewards, entropies=ENTROPIES, eval_=ev)
    logged = make_run(tmp_path / "b", "stare", "stare", 0, rewards=rewards, entropies=ENTROPIES, eval_=ev,
                      extra=extra)
    write_comparison(tmp_path / "out_a", [load_run(plain)])
    write_comparison(tmp_path / "out_b", [load_run(logged)])
    md_a = (tmp_path / "out_a" / "comparison.md").read_text()
    md_b = (tmp_path / "out_b" / "comparison.md").read_text()
    assert "Selection telemetry" not in md_a
    assert md_b.startswith(md_a) and md_b[len(md_a):].startswith("\n## Selection telemetry\n")
    assert telemetry_table(md_b)["stare"]["gate on"] == "0.500"  # 10 of 20 steps
    assert (tmp_path / "out_a" / "comparison.csv").read_bytes() == (tmp_path / "out_b" / "comparison.csv").read_bytes()


def test_token_rules_own_telemetry_gets_columns_where_logged(tmp_path):
    """dg's and entropy-adv's own numbers (declared on their token rules) reach comparison.json and get columns in
    comparison.md, each arm's step mean worked out by hand; steer's, which no arm logged, get no column, and the
    shared columns keep their places."""
    rewards, ents = [0.5] * 4, [0.6] * 4
    dg = {i: {"stare/mean_weight": 0.5, "stare/gate_mean": g, "stare/gate_low_share": lo, "stare/gate_high_share": hi}
          for i, g, lo, hi in zip(range(1, 5), (0.4, 0.5, 0.6, 0.7), (0.2, 0.1, 0.1, 0.0), (0.0, 0.1, 0.3, 0.4))}
    adv = {i: {"stare/mean_weight": 1.1, "stare/shaped_share": s} for i, s in zip(range(1, 5), (0.9, 0.8, 0.7, 0.6))}
    adv[2]["stare/shaping_clipped_share"] = 0.25  # logged at one step only (no shaped token clipped at the others)
    runs = [load_run(make_run(tmp_path, "g", "dg", 0, rewards=rewards, entropies=ents, extra=dg)),
            load_run(make_run(tmp_path, "e", "entropy-adv", 0, rewards=rewards, entropies=ents, extra=adv))]
    summary = write_comparison(tmp_path / "out", runs)
    arms = {a["arm"]: a["telemetry"] for a in summary["arms"]}
    assert arms["dg"]["gate_mean"]["mean"] == pytest.approx(0.55)
    assert arms["dg"]["gate_high_share"]["mean"] == pytest.approx(0.2)
    assert arms["entropy-adv"]["shaped_share"]["mean"] == pytest.approx(0.75)
    assert arms["entropy-adv"]["shaping_clipped_share"]["mean"] == pytest.approx(0.25)
    assert arms["dg"]["steer_floor_share"] == {"mean": None, "std": None, "n": 0}  # in the JSON, never logged
    md = (tmp_path / "out" / "comparison.md").read_text()
    rows = telemetry_table(md)
    assert list(rows["dg"]) == ["arm", "seeds", "gate on", "mean weight", "boosted Phi>0", "lowered Phi>0", "masked",
                                "penalised", "forecast", "forecast unweighted", "shaped", "shaping clipped",
                                "gate mean", "gate<0.1", "gate>0.9"]
    assert (rows["dg"]["gate mean"], rows["dg"]["gate<0.1"], rows["dg"]["gate>0.9"]) == ("0.550", "0.100", "0.200")
    assert (rows["dg"]["shaped"], rows["entropy-adv"]["gate mean"]) == ("", "")
    assert (rows["entropy-adv"]["shaped"], rows["entropy-adv"]["shaping clipped"]) == ("0.750", "0.250")
    assert "gate mean (dg): mean of the delight gate" in md and "`stare/shaped_share`" in md and "steer" not in md
