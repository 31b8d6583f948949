"""Accuracy over training: `stare eval --checkpoints` over a run's kept policies (stopped, resumed), the local
engine's keep_checkpoint_every and eval_every, and `stare compare`'s curve and best/last columns, each number
checked against one computed here (a direct harness run, the samples by hand, the bootstrap written out)."""
import csv
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import yaml

from stare.cli.errors import CliError
from tiny_models import PROBLEMS, _fit, build_tiny_model, write_problems

STEPS = (10, 20, 30)  # the OpenRLHF-style run's checkpoints
EVAL_ARGS = ["--k", "4", "--max-tokens", "8", "--backend", "hf", "--seed", "3"]
# small enough for seconds per arm on two cores (as in test_local_engine.py)
FAST = ["warmstart_steps=100", "warmstart_noise=0.3", "eval_problems=8", "prompts_per_step=4", "samples_per_prompt=4",
        "train_problems=200", "micro_batch_size=8"]


def stare(*args):
    return subprocess.run([sys.executable, "-m", "stare.cli.main", *args], capture_output=True, text=True)


def one_line(res):
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    return lines[0]


def bootstrap(values, n_boot=2000, seed=0):
    """The percentile bootstrap of the mean over problems, written out: 2000 resamples, the 2.5% and 97.5%
    quantiles (numpy's default linear interpolation), from numpy's default generator seeded 0."""
    x = np.asarray(values, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(x), size=(n_boot, len(x)))
    lo, hi = np.quantile(x[idx].mean(axis=1), [0.025, 0.975])
    return float(lo), float(hi)


def by_hand(step_dir):
    """avg@k and its interval from a step folder's samples.jsonl alone."""
    rows = [json.loads(x) for x in (step_dir / "samples.jsonl").read_text().splitlines()]
    per_problem = []
    for p in PROBLEMS:
        mine = [r["correct"] for r in rows if r["problem_id"] == p["id"]]
        assert len(mine) == 4
        per_problem.append(sum(mine) / 4)
    return sum(per_problem) / len(per_problem), bootstrap(per_problem)


@pytest.fixture(scope="module")
def openrlhf_run(tmp_path_factory):
    """An OpenRLHF run folder as `stare train` leaves it with save_hf_checkpoints and eval_every: config.yaml,
    ckpt/global_step<S>_hf/ (one tiny model trained a little more at each step, so accuracy moves), a
    best_global_step copy and a cut save (both ignored), and TensorBoard logs with OpenRLHF's eval tags."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from torch.utils.tensorboard import SummaryWriter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("orl") / "qwen-stare"
    root.mkdir()
    (root / "config.yaml").write_text(yaml.safe_dump({
        "preset": "qwen-7b-short-cot", "backend": "openrlhf", "algo": {"name": "stare", "band_low": 0.3,
                                                                       "band_high": 0.45},
        "settings": {"model": "Qwen/Qwen2.5-Math-7B", "seed": 42}}))
    ckpt = root / "ckpt"
    first = build_tiny_model(tmp_path_factory.mktemp("untrained"))
    model, tok = AutoModelForCausalLM.from_pretrained(first), AutoTokenizer.from_pretrained(first)
    for step, fit in ((10, 14), (20, 4), (30, 6)):  # avg@4 about 0.08, 0.42, 0.5 here: a few seconds of fitting
        _fit(model, tok, fit)
        model.save_pretrained(ckpt / f"global_step{step}_hf")
        tok.save_pretrained(ckpt / f"global_step{step}_hf")
    shutil.copytree(ckpt / "global_step20_hf", ckpt / "best_global_step20_hf")
    (ckpt / "global_step40_hf").mkdir()  # a save cut before its config.json
    writer = SummaryWriter(log_dir=str(root / "tensorboard" / "qwen-stare"))
    for step in range(1, 31):
        writer.add_scalar("train/reward", 0.01 * step, step)
        writer.add_scalar("train/stare/entropy", 0.5, step)
    for step, value in zip(STEPS, (0.125, 0.5, 0.375)):  # OpenRLHF's compute_eval_metrics, n_samples_per_prompt 4
        writer.add_scalar("eval/eval_aime24_pass1", value, step)
        writer.add_scalar("eval/eval_aime24_pass4", 1.0, step)
        writer.add_scalar("eval/eval_response_length_mean", 7.0, step)
    writer.close()
    data = write_problems(root.parent / "problems.jsonl")
    return root, data


def test_checkpoint_sweep_resumes_and_compare_draws_the_curve(openrlhf_run, tmp_path):
    from stare.cli.report.compare import compare
    from stare.cli.eval_sweep import plan_sweep
    from stare.cli.rundir import saved_checkpoints
    from stare.eval import load_bench
    from stare.eval.backends import HFBackend
    from stare.eval.harness import run_eval
    from stare.eval.protocols import resolve_protocol

    root, data = openrlhf_run
    assert [s for s, _ in saved_checkpoints(root)] == list(STEPS)
    sweep = ["eval", "--bench", "aime24", "--out", str(root), "--data-file", str(data), *EVAL_ARGS]
    res = stare(*sweep, "--checkpoints", "all")
    assert res.returncode == 0, res.stderr[-3000:]
    evals = root / "eval-aime24"
    assert sorted(p.name for p in evals.iterdir()) == [f"step-{s}" for s in STEPS]
    whole = {s: json.loads((evals / f"step-{s}" / "summary.json").read_text()) for s in STEPS}
    kept = {s: (evals / f"step-{s}" / "samples.jsonl").read_bytes() for s in (10, 20)}
    # without --resume a finished step is refused, not silently redone (before anything is written)
    with pytest.raises(CliError, match="step-10 already holds a finished evaluation; pass --resume to continue"):
        plan_sweep(out=root, spec="all", bench="aime24", model=None, harness="stare", resume=False, protocol="stare",
                   k=4, temperature=None, top_p=None, max_tokens=8, backend="hf", tp=1, data_file=data, limit=None,
                   seed=3, tools=None)
    # a sweep killed inside step 30: its first problem written, the next cut mid-line, no summary yet
    lines = (evals / "step-30" / "samples.jsonl").read_text().splitlines(keepends=True)
    (evals / "step-30" / "samples.jsonl").write_text("".join(lines[:4]) + lines[4][:20])
    (evals / "step-30" / "summary.json").unlink()
    res = stare(*sweep, "--checkpoints", "all", "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "last line was cut" in res.stderr and res.stdout.count(": kept (") == 2  # steps 10 and 20 kept
    assert {s: (evals / f"step-{s}" / "samples.jsonl").read_bytes() for s in (10, 20)} == kept
    again = json.loads((evals / "step-30" / "summary.json").read_text())
    assert again["avg_at_k"] == whole[30]["avg_at_k"] and again["ci95"] == whole[30]["ci95"]

    # each step by hand from its samples, and step 10 evaluated again straight through the harness
    points = {s: by_hand(evals / f"step-{s}") for s in STEPS}
    assert len({v for v, _ in points.values()}) > 1, points  # the checkpoints differ: a curve, not a constant
    ckpt10 = str(root / "ckpt" / "global_step10_hf")
    direct = run_eval(load_bench("aime24", data_file=str(data)), HFBackend(ckpt10),
                      resolve_protocol("stare", k=4, max_tokens=8), tmp_path / "direct", bench="aime24", model=ckpt10,
                      seed=3, resume=False)
    assert direct["avg_at_k"] == pytest.approx(points[10][0])
    assert (tmp_path / "direct" / "samples.jsonl").read_text() == (evals / "step-10" / "samples.jsonl").read_text()

    out = tmp_path / "cmp"
    compare([root], out)
    (arm,) = json.loads((out / "comparison.json").read_text())["arms"]
    curve = arm["curves"]["aime24_checkpoint"]
    (run,) = curve["runs"]
    assert [p["step"] for p in run["points"]] == list(STEPS)
    for p in run["points"]:
        value, (lo, hi) = points[p["step"]]
        assert p["value"] == pytest.approx(value) and p["k"] == 4
        assert (p["ci_low"], p["ci_high"]) == pytest.approx((lo, hi))
    values = [points[s][0] for s in STEPS]
    best = max(values)
    best_step = STEPS[values.index(best)]  # the first step reaching it
    assert (run["best"], run["best_step"], run["last"], run["last_step"]) == pytest.approx(
        (best, best_step, values[-1], 30))
    # OpenRLHF's own in-training evaluation, from its eval/ tags: the same kind of curve, n from pass4
    tb = arm["curves"]["aime24_in_training"]["runs"][0]
    assert [(p["step"], p["value"], p["k"]) for p in tb["points"]] == [(10, 0.125, 4), (20, 0.5, 4), (30, 0.375, 4)]
    assert (tb["best"], tb["best_step"], tb["last"]) == (0.5, 20, 0.375)
    (row,) = csv.DictReader((out / "comparison.csv").open())
    assert float(row["aime24_checkpoint_best_mean"]) == pytest.approx(best)
    assert row["aime24_checkpoint_best_step"] == str(best_step) and row["aime24_checkpoint_last_step"] == "30"
    assert float(row["aime24_checkpoint_last_mean"]) == pytest.approx(values[-1])
    assert float(row["aime24_in_training_best_mean"]) == 0.5 and row["aime24_in_training_best_std"] == ""
    md = (out / "comparison.md").read_text()
    assert "aime24 (checkpoints) best" in md and f"{best:.3f} (step {best_step})" in md
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_checkpoint_requests_are_one_line(openrlhf_run, tmp_path):
    from stare.cli.eval_sweep import plan_sweep

    root, data = openrlhf_run
    args = dict(bench="aime24", harness="stare", resume=True, protocol="stare", k=4, temperature=None, top_p=None,
                max_tokens=8, backend="hf", tp=1, data_file=data, limit=None, seed=3, tools=None)
    for spec, message in (("every:0", "--checkpoints 'every:0': expected all, or every:N"),
                          ("some", "--checkpoints 'some': expected all, or every:N"),
                          ("every:7", "kept no checkpoint at a multiple of 7 (its steps: 10, 20, 30)")):
        with pytest.raises(CliError, match=re.escape(message)):
            plan_sweep(out=root, spec=spec, model=None, **args)
    assert [p.step for p in plan_sweep(out=root, spec="every:20", model=None, **args)] == [20]
    with pytest.raises(CliError, match="leave --model out"):
        plan_sweep(out=root, spec="all", model="x/y", **args)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.yaml").write_text("preset: tiny-cpu\n")
    with pytest.raises(CliError, match="has no saved checkpoints .*keep_checkpoint_every=N"):
        plan_sweep(out=bare, spec="all", model=None, **args)
    assert not any(bare.glob("eval-*"))  # nothing written
    line = one_line(stare("eval", "--bench", "aime24", "--out", str(root), "--checkpoints", "every:x"))
    assert "--checkpoints 'every:x': expected all, or every:N" in line


def test_local_run_keeps_checkpoints_and_evaluates_in_training(tmp_path):
    """keep_checkpoint_every and eval_every move no training number (same metrics and eval.json as a run without
    them); the kept last step is the final model; the in-training evaluation at the last step is eval.json's."""
    from stare.cli.report.compare import compare
    from stare.cli.local.trainer import LocalTrainer
    from stare.cli.presets import resolve
    from stare.cli.rundir import prepare_run_dir, saved_checkpoints

    sets = FAST + ["steps=5", "warmstart_steps=60"]
    plain, curves, warm = tmp_path / "plain", tmp_path / "curves", tmp_path / "warmstart"
    for run, extra in ((plain, []), (curves, ["keep_checkpoint_every=2", "eval_every=2"])):
        resolved = resolve("tiny-cpu", "grpo", sets + extra)
        prepare_run_dir(run, resolved, False)
        LocalTrainer(resolved, run, warmstart_dir=warm).run()  # one warm start for both

    def metrics(run):
        return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]

    def training(rows):
        return [{k: v for k, v in r.items() if k != "time_s" and not k.startswith("heldout/")} for r in rows]

    assert training(metrics(curves)) == training(metrics(plain))
    final_eval = json.loads((curves / "eval.json").read_text())
    assert final_eval == json.loads((plain / "eval.json").read_text())
    assert [s for s, _ in saved_checkpoints(curves)] == [2, 4, 5]  # every 2nd step and the last
    assert (curves / "checkpoints" / "step-5" / "model.safetensors").read_bytes() == \
        (curves / "final" / "model.safetensors").read_bytes()
    assert (curves / "checkpoints" / "step-2" / "model.safetensors").read_bytes() != \
        (curves / "final" / "model.safetensors").read_bytes()
    held = {r["step"]: r for r in metrics(curves) if "heldout/avg_at_k" in r}
    assert sorted(held) == [2, 4, 5]
    assert held[5]["heldout/avg_at_k"] == final_eval["avg_at_k"] and held[5]["heldout/k"] == final_eval["k"]
    assert held[5]["heldout/pass_at_k"] == final_eval["pass_at_k"]
    for r in held.values():
        assert r["heldout/ci_low"] <= r["heldout/avg_at_k"] <= r["heldout/ci_high"]
    compare([plain, curves], tmp_path / "cmp")
    rows = {r["arm"]: r for r in csv.DictReader((tmp_path / "cmp" / "comparison.csv").open())}
    values = [held[s]["heldout/avg_at_k"] for s in (2, 4, 5)]
    row = next(r for label, r in rows.items() if str(curves) in label)
    assert float(row["heldout_in_training_last_mean"]) == pytest.approx(values[-1])
    assert float(row["heldout_in_training_best_mean"]) == pytest.approx(max(values))
    assert row["heldout_in_training_best_step"] == str((2, 4, 5)[values.index(max(values))])
    other = next(r for label, r in rows.items() if str(plain) in label)
    assert other["heldout_in_training_best_mean"] == ""  # no curve: blank, not 0
    assert (tmp_path / "cmp" / "accuracy.png").is_file()
