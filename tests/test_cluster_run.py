"""`stare run` on a GPU preset, without a cluster: the plan (folders, seeds, commands, states), the refusals made
before anything is written, the GPUs an arm holds, the --parallel check against a cluster's resources, and the
orchestration of failed steps (real child processes of stare commands that fail or succeed at once). The run through
OpenRLHF's real loop and the real vLLM engine is tests/test_openrlhf_e2e.py's (test_stare_run_*)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stare.cli import cluster_run as cr
from stare.cli.errors import CliError
from stare.cli.run_set import resolve_run_set

PRESET = "qwen-7b-short-cot"


def stare(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stare.cli.main", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def plan_json(tmp_path, *args) -> dict:
    res = stare("run", "--preset", PRESET, "--out", tmp_path / "out", "--dry-run", *args)
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "out").exists(), "a dry run wrote something"
    return json.loads(res.stdout)


def test_plan_has_a_folder_seed_and_command_per_arm_and_seed(tmp_path):
    plan = plan_json(tmp_path, "--algos", "grpo,stare", "--seeds", "2", "--bench", "aime25", "--set", "lr=2e-6",
                     "--k", "4", "--limit", "3")
    out = (tmp_path / "out").absolute()
    trains = [s for s in plan["steps"] if s["step"] == "train"]
    assert [(s["arm"], s["seed"], s["out"]) for s in trains] == [
        ("grpo", 42, str(out / "grpo" / "seed0")), ("grpo", 43, str(out / "grpo" / "seed1")),
        ("stare", 42, str(out / "stare" / "seed0")), ("stare", 43, str(out / "stare" / "seed1"))]
    for s in trains:
        cmd = s["command"]
        assert cmd[:8] == ["stare", "train", "--preset", PRESET, "--algo", s["arm"], "--out", s["out"]]
        assert cmd[8:] == ["--set", "lr=2e-6", "--set", f"seed={s['seed']}"]  # the user's sets, then the seed
        assert s["openrlhf_argv"][s["openrlhf_argv"].index("--train.seed") + 1] == str(s["seed"])
        assert s["openrlhf_argv"][s["openrlhf_argv"].index("--actor.adam.lr") + 1] == "2e-06"
    evals = [s for s in plan["steps"] if s["step"] == "eval"]
    assert [(s["arm"], s["seed"], s["out"]) for s in evals] == [
        (t["arm"], t["seed"], t["out"] + "/eval-aime25") for t in trains]
    for s in evals:
        cmd = s["command"]
        assert cmd[cmd.index("--k") + 1] == "4" and cmd[cmd.index("--limit") + 1] == "3"
        assert cmd[cmd.index("--seed") + 1] == "0"  # every arm evaluated on the same draws
    # a training is followed by its own evaluations
    assert [s["step"] for s in plan["steps"]] == ["train", "eval"] * 4
    assert (plan["kept"], plan["to_run"]) == (0, 8)


def test_stare_run_dry_run_prints_every_step_and_writes_nothing(tmp_path):
    """The plan of the GPU preset's comparison (the defaults: grpo, dapo, stare on AIME24/25, one seed): one
    training per arm with the OpenRLHF argv `stare train --dry-run` prints for it, then one evaluation per
    benchmark of that run's folder; nothing is written."""
    out = tmp_path / "plan"
    proc = stare("run", "--preset", PRESET, "--out", out, "--dry-run", cwd=tmp_path)
    plan = json.loads(proc.stdout)
    assert not out.exists()
    assert (plan["arms"], plan["benches"], plan["seeds"]) == (["grpo", "dapo", "stare"], ["aime24", "aime25"], 1)
    want = []
    for arm in ("grpo", "dapo", "stare"):
        want += [("train", arm, None), ("eval", arm, "aime24"), ("eval", arm, "aime25")]
    assert [(s["step"], s["arm"], s.get("bench")) for s in plan["steps"]] == want
    for s in plan["steps"]:
        assert s["state"] == "new" and s["seed"] == 42
        if s["step"] == "train":
            alone = json.loads(stare("train", "--preset", PRESET, "--algo", s["arm"], "--out", s["out"],
                                     "--set", "seed=42", "--dry-run", cwd=tmp_path).stdout)
            assert s["openrlhf_argv"] == alone["openrlhf_argv"], s["arm"]
        else:
            assert s["command"][:5] == ["stare", "eval", "--bench", s["bench"], "--out"]


@pytest.mark.parametrize("args, message", [
    (["--parallel", "2"], "--parallel 2: arms run at once only on a Ray cluster"),
    (["--bench", "aime26"], "'aime26'"),
    (["--bench", "aime25,aime25"], "--bench 'aime25,aime25'"),
    (["--set", "benches=aime24,gsm8k"], "unknown benchmark 'gsm8k'"),
    (["--set", "eval_protocol=greedy"], "must be one of stare, dapo, r1"),
    (["--algos", "grpo,ppo"], "unknown algorithm 'ppo'"),
    # one arm's training is refused by stare train --dry-run (dapo's 614-token overlong zone does not fit 16 tokens)
    (["--algos", "grpo,dapo", "--set", "max_response_len=16"], "overlong_buffer_len"),
    (["--ray-address", "nohost"], "is not HOST:PORT"),
    (["--backend", "tpu"], "unknown backend 'tpu'"),
])
def test_refusals_are_one_line_exit_2_and_write_nothing(tmp_path, args, message):
    res = stare("run", "--preset", PRESET, "--out", tmp_path / "out", *args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "out").exists()


def test_gpu_flags_on_a_local_preset_are_refused(tmp_path):
    res = stare("run", "--preset", "tiny-cpu", "--out", tmp_path / "out", "--ray-address", "auto")
    assert res.returncode == 2 and "--ray-address is for GPU presets" in res.stderr, res.stderr


def _fake_finished_training(run_dir: Path, resolved: dict) -> None:
    """A training folder as a finished stare train leaves it: config.yaml and a whole final model."""
    import torch
    from safetensors.torch import save_file

    from stare.cli.rundir import prepare_run_dir

    prepare_run_dir(run_dir, resolved, resume=False)
    (run_dir / "final").mkdir()
    (run_dir / "final" / "config.json").write_text("{}")
    save_file({"w": torch.zeros(4)}, str(run_dir / "final" / "model.safetensors"))


def _arm_set(*sets):
    return resolve_run_set(PRESET, list(sets), algos="grpo,dapo", seeds=1)


def _plan(out, *, resume, evals=None, parallel=1, ray_address=None, arm_set=None):
    return cr.plan_cluster_run(arm_set or _arm_set(), out, preset_arg=PRESET, sets=[],
                               evals=evals or cr.EvalOptions(["aime25"], "stare"), ray_address=ray_address,
                               resume=resume, parallel=parallel)


def test_resume_keeps_a_finished_training_and_evaluation_and_resumes_the_rest(tmp_path):
    out = tmp_path / "out"
    arm_set = _arm_set()
    grpo = json.loads(json.dumps(arm_set.resolved["grpo"]))
    grpo["settings"]["seed"] = 42
    _fake_finished_training(out / "grpo" / "seed0", grpo)
    (out / "grpo" / "seed0" / "eval-aime25").mkdir()
    (out / "grpo" / "seed0" / "eval-aime25" / "summary.json").write_text('{"bench": "aime25"}')
    dapo = json.loads(json.dumps(arm_set.resolved["dapo"]))
    dapo["settings"]["seed"] = 42
    from stare.cli.rundir import prepare_run_dir

    prepare_run_dir(out / "dapo" / "seed0", dapo, resume=False)  # started, interrupted before its final model
    from stare.cli.rundir import mark_run_set

    mark_run_set(out, PRESET, ["grpo", "dapo"], 1)
    with pytest.raises(CliError, match="already holds a run; pass --resume"):
        _plan(out, resume=False)
    plan = _plan(out, resume=True)
    states = [(s.name, s.state, "--resume" in s.command) for s in plan.steps]
    assert states == [("train grpo seed0", "kept", False), ("eval grpo seed0 aime25", "kept", False),
                      ("train dapo seed0", "resume", True), ("eval dapo seed0 aime25", "new", False)]
    # a final model cut short is not a finished training
    weights = out / "grpo" / "seed0" / "final" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    assert _plan(out, resume=True).steps[0].state == "resume"


def test_resumed_evaluation_with_other_settings_is_refused(tmp_path):
    out = tmp_path / "out"
    arm_set = _arm_set()
    grpo = json.loads(json.dumps(arm_set.resolved["grpo"]))
    grpo["settings"]["seed"] = 42
    run_dir = out / "grpo" / "seed0"
    _fake_finished_training(run_dir, grpo)
    from stare.cli.rundir import mark_run_set

    mark_run_set(out, PRESET, ["grpo", "dapo"], 1)
    folder = run_dir / "eval-aime25"
    folder.mkdir()
    sample = {"problem_id": "x", "sample_idx": 3, "completion": "", "extracted": None, "correct": False,
              "num_tokens": 0}
    (folder / "samples.jsonl").write_text(json.dumps(sample) + "\n")  # drawn with k >= 4
    assert _plan(out, resume=True, evals=cr.EvalOptions(["aime25"], "stare", k=4)).steps[1].state == "resume"
    with pytest.raises(CliError, match="--k 2"):
        _plan(out, resume=True, evals=cr.EvalOptions(["aime25"], "stare", k=2))


@pytest.mark.parametrize("settings, evals, want", [
    # colocated: the actor ranks are the engines' GPUs (8); the evaluation's 4 x 1 fit in them
    ({"gpus_per_node": 8, "nodes": 1, "colocate": True, "vllm_engines": 8, "vllm_tensor_parallel": 1,
      "kl_coef": 0.0}, (4, 1), 8),
    # not colocated: 4 actor ranks + 2 engines x tp 2, and a reference model on 4 more
    ({"gpus_per_node": 4, "nodes": 1, "colocate": False, "vllm_engines": 2, "vllm_tensor_parallel": 2,
      "kl_coef": 0.01}, (1, 1), 12),
    # two nodes of 8, colocated; the evaluation asks for fewer
    ({"gpus_per_node": 8, "nodes": 2, "colocate": True, "vllm_engines": 4, "vllm_tensor_parallel": 4,
      "kl_coef": 0.0}, (2, 2), 16),
    # a small training whose evaluation asks for more: 8 engines x tp 2
    ({"gpus_per_node": 1, "nodes": 1, "colocate": True, "vllm_engines": 1, "vllm_tensor_parallel": 1,
      "kl_coef": 0.0}, (8, 2), 16),
])
def test_gpus_per_arm_by_hand(settings, evals, want):
    assert cr.gpus_per_arm(settings, cr.EvalOptions(["aime25"], "stare", engines=evals[0], tp=evals[1])) == want


def test_parallel_is_checked_against_the_clusters_gpus(tmp_path):
    plan = _plan(tmp_path / "out", resume=False, parallel=2, ray_address="10.0.0.1:6379")
    assert plan.gpus_per_arm == 8
    with pytest.raises(CliError, match=r"--parallel 2: 2 arms of qwen-7b-short-cot at once need 16 GPUs \(8 each\), "
                                       r"and the Ray cluster at 10.0.0.1:6379 has 15; use --parallel 1"):
        cr.check_cluster(plan, {"GPU": 15.0, "CPU": 128.0})
    cr.check_cluster(plan, {"GPU": 16.0})  # exactly enough
    plan.parallel = 3
    with pytest.raises(CliError, match="need 24 GPUs"):
        cr.check_cluster(plan, {"GPU": 16.0})
    assert not (tmp_path / "out").exists()


def test_a_failed_training_is_recorded_its_evaluations_skipped_and_the_other_arms_go_on(tmp_path):
    """Real child processes: grpo's training is a stare command that fails at once (an unknown preset), dapo's
    steps are stare commands that succeed. The failure's line names the step, stare's error line and the log; grpo's
    evaluation never starts; dapo's steps all run, in order, after grpo's failure."""
    plan = _plan(tmp_path / "out", resume=False)
    grpo_train, grpo_eval, dapo_train, dapo_eval = plan.steps
    grpo_train.command = ["train", "--preset", "no-such-preset"]
    dapo_train.command, dapo_eval.command = ["presets"], ["algos"]
    lines = []
    failures = cr.run_cluster(plan, lines.append)
    assert len(failures) == 1, failures
    assert failures[0].startswith("train grpo seed0 failed: error: unknown preset 'no-such-preset'")
    assert failures[0].endswith(f"(log: {grpo_train.log})")
    assert not grpo_eval.log.exists()
    assert "stare presets" in dapo_train.log.read_text() and "stare algorithms" in dapo_eval.log.read_text()
    text = "\n".join(lines)
    assert "train grpo seed0: FAILED after" in text and "(exit 2)" in text
    assert text.index("train dapo seed0: finished") < text.index("eval dapo seed0 aime25: finished")
    assert yaml.safe_load((plan.out / "run.yaml").read_text())["algos"] == ["grpo", "dapo"]


@pytest.mark.parametrize("log, want", [
    ("starting\nerror: bad thing\nmore output\n", "error: bad thing"),
    ("Traceback (most recent call last):\n  File x\nValueError: boom\nshutting down\n", "ValueError: boom"),
    ("just output\nlast words\n", "last words"),
])
def test_error_line_picks_the_line_that_says_why(tmp_path, log, want):
    path = tmp_path / "x.log"
    path.write_text(log)
    assert cr.error_line(path) == want


def test_an_evaluation_folder_a_failed_start_left_is_new(tmp_path):
    """Issue 58 item 3: a record with no sample (what `stare eval` wrote before it failed, e.g. at --k 100000000) is
    no evaluation to resume or to refuse: the plan starts it afresh, as `stare eval` does."""
    out = tmp_path / "out"
    grpo = json.loads(json.dumps(_arm_set().resolved["grpo"]))
    grpo["settings"]["seed"] = 42
    run_dir = out / "grpo" / "seed0"
    _fake_finished_training(run_dir, grpo)
    from stare.cli.rundir import mark_run_set

    mark_run_set(out, PRESET, ["grpo", "dapo"], 1)
    folder = run_dir / "eval-aime25"
    folder.mkdir()
    (folder / "eval_settings.json").write_text(json.dumps({"protocol": "stare", "k": 100000000}))
    (folder / "samples.jsonl").write_text("")
    assert _plan(out, resume=True, evals=cr.EvalOptions(["aime25"], "stare", k=2)).steps[1].state == "new"
