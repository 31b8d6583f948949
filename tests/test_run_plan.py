"""`stare run --dry-run` predicts the run (issue 58 item 5): on the same folders the dry run and the run make one
decision per arm (kept / resume / new) or the same one-line refusal; a GPU preset's dry run needs no Ray.

Each case copies one finished local run, changes it as a user's folder would be (finished, an arm interrupted, an
arm never started, other settings, a corrupt metrics line, another preset's folder), then runs the dry run and the
run on it. What the run did is read off the folders, not off the run's own words: a kept arm's files are byte for
byte what they were, a resumed arm had its config.yaml before and has its eval.json after, a new arm had no folder.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stare.cli.main import app

# a few seconds per arm on two cores
FAST = ["warmstart_steps=60", "eval_problems=4", "prompts_per_step=2", "samples_per_prompt=4", "train_problems=50",
        "micro_batch_size=8", "steps=3", "save_every=2"]
SETS = sum((["--set", s] for s in FAST), [])
ARMS = ("grpo", "dapo")


def stare(*args):
    """The CLI in this process (the arms still train in worker processes): exit_code, stdout, stderr."""
    return CliRunner().invoke(app, [str(a) for a in args])


def stare_process(*args, prelude: str = "") -> subprocess.CompletedProcess:
    code = prelude + "import sys; from stare.cli.main import main; sys.argv = ['stare', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=120)


def run_args(out, *extra):
    return ["run", "--preset", "tiny-cpu", "--algos", ",".join(ARMS), "--seeds", "1", "--out", out, *SETS, *extra]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A fresh folder, planned and run: every arm new."""
    out = tmp_path_factory.mktemp("plan") / "done"
    assert dry_then_run(out) == {"grpo": "new", "dapo": "new"}
    return out


def files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def error_line(res) -> str:
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    return lines[0]


def dry_then_run(out: Path, *extra) -> dict | str:
    """The dry run's decision on ``out``, then the run on the same folder, checked against it: the states by arm, or
    the refusal line both gave."""
    before = {a: files(out / a) if (out / a).is_dir() else None for a in ARMS}
    everything = files(out) if out.is_dir() else {}
    dry = stare(*run_args(out, *extra, "--dry-run"))
    assert (files(out) if out.is_dir() else {}) == everything, "the dry run wrote something"
    real = stare(*run_args(out, *extra))
    if dry.exit_code != 0:
        assert dry.exit_code == real.exit_code == 2, (dry.output[-2000:], real.output[-2000:])
        assert error_line(dry) == error_line(real)
        assert (files(out) if out.is_dir() else {}) == everything, "a refused run wrote something"
        return error_line(dry)
    assert real.exit_code == 0, real.output[-3000:]
    plan = json.loads(dry.stdout)
    states = {r["arm"]: r["state"] for r in plan["steps"]}
    assert plan["runs"] == [{k: v for k, v in r.items() if k != "step"} for r in plan["steps"]]  # the old key
    assert (plan["kept"], plan["to_run"]) == (list(states.values()).count("kept"),
                                              len(states) - list(states.values()).count("kept"))
    for arm, state in states.items():
        after = files(out / arm)
        if state == "kept":
            assert after == before[arm], f"{arm}: planned kept, changed by the run"
        elif state == "resume":
            assert before[arm] is not None and "config.yaml" in before[arm] and "eval.json" in after
            assert before[arm]["config.yaml"] == after["config.yaml"]
        else:
            assert state == "new" and not before[arm] and "eval.json" in after
    return states


def copy(finished, tmp_path) -> Path:
    out = tmp_path / "runs"
    shutil.copytree(finished, out)
    return out


def test_a_finished_folder_without_resume_is_refused_by_both(finished, tmp_path):
    """The issue's case: the dry run said "kept" where the run refused."""
    out = copy(finished, tmp_path)
    line = dry_then_run(out)
    assert line == f"error: {out / 'grpo'} already holds a run; pass --resume to continue it or use another --out " \
                   "(nothing was changed)"


def test_a_fresh_folder_is_new_for_both(finished):
    assert (finished / "comparison.md").is_file()  # the fixture: dry_then_run on a fresh folder


def test_a_finished_folder_with_resume_is_kept_by_both(finished, tmp_path):
    assert dry_then_run(copy(finished, tmp_path), "--resume") == {"grpo": "kept", "dapo": "kept"}


def test_an_interrupted_arm_resumes_and_one_never_started_is_new(finished, tmp_path):
    out = copy(finished, tmp_path)
    (out / "grpo" / "eval.json").unlink()  # interrupted after its last checkpoint
    shutil.rmtree(out / "dapo")  # never started
    assert dry_then_run(out, "--resume") == {"grpo": "resume", "dapo": "new"}


@pytest.mark.parametrize("case", ["other settings", "corrupt metrics", "another preset", "resume nothing"])
def test_what_the_run_refuses_the_dry_run_refuses_with_the_same_line(finished, tmp_path, case):
    out = copy(finished, tmp_path)
    extra = ["--resume"]
    if case == "other settings":
        extra += ["--set", "lr=0.01"]
        want = f"{out / 'grpo'} was started with other settings"
    elif case == "corrupt metrics":
        (out / "dapo" / "eval.json").unlink()
        metrics = out / "dapo" / "metrics.jsonl"
        lines = metrics.read_text().splitlines(keepends=True)
        metrics.write_text(lines[0] + "{not json\n" + "".join(lines[1:]))
        want = "metrics.jsonl line 2 is corrupt"
    elif case == "another preset":
        marker = out / "run.yaml"
        marker.write_text(marker.read_text().replace("tiny-cpu", "tiny-explore"))
        want = "holds a run of preset 'tiny-explore'"
    else:  # a folder holding something that is not a stare run
        out = tmp_path / "other"
        out.mkdir()
        (out / "notes.txt").write_text("mine\n")
        extra = []
        want = "is not empty and holds no stare run"
    line = dry_then_run(out, *extra)
    assert want in line, line


BLOCK_RAY = """
import importlib.abc, importlib.util
_real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split('.')[0] == 'ray' else _real(name, *a)
class _NoRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] == 'ray':
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)
sys.meta_path.insert(0, _NoRay())
"""


@pytest.mark.parametrize("extra", [[], ["--engines", "8"], ["--engines", "2", "--tp", "4"]])
def test_a_gpu_dry_run_needs_no_ray(tmp_path, extra):
    """`stare run --preset qwen-7b-short-cot --engines 8 --dry-run` where Ray cannot be imported: the plan, exit 0;
    the run itself needs Ray (checked when it starts)."""
    res = stare_process("run", "--preset", "qwen-7b-short-cot", "--out", tmp_path / "r", *extra, "--dry-run",
                        prelude="import sys\n" + BLOCK_RAY)
    assert res.returncode == 0, res.stderr[-2000:]
    plan = json.loads(res.stdout)
    engines = int(extra[1]) if extra else 8
    assert plan["eval_layout"]["engines"] == engines
    assert all(s["command"][s["command"].index("--engines") + 1] == str(engines)
               for s in plan["steps"] if s["step"] == "eval")
    assert not (tmp_path / "r").exists()


def test_both_engines_print_one_plan_shape(tmp_path):
    """A local and a GPU preset's `stare run --dry-run` share the plan's keys (the GPU one adds its own: benches,
    eval layout, ...), each step is {step, arm, seed, out, state, ...} in arm x seed order, the comparison goes to
    OUT/comparison.md, and kept + to_run counts every step."""
    plans = {}
    for preset in ("tiny-cpu", "qwen-1.5b-1gpu"):
        res = stare("run", "--preset", preset, "--algos", "grpo,dapo", "--seeds", "2", "--out", tmp_path / preset,
                    "--dry-run")
        assert res.exit_code == 0, res.output[-2000:]
        plans[preset] = json.loads(res.stdout)
    shared = ["preset", "out", "arms", "seeds", "steps", "comparison", "kept", "to_run"]
    for preset, plan in plans.items():
        assert [k for k in plan if k in shared] == shared, (preset, list(plan))
        assert plan["arms"] == ["grpo", "dapo"] and plan["seeds"] == 2
        assert plan["comparison"] == str(tmp_path / preset / "comparison.md")
        trains = [(s["arm"], s["out"]) for s in plan["steps"] if s["step"] == "train"]
        assert trains == [(a, str(tmp_path / preset / a / f"seed{i}")) for a in ("grpo", "dapo") for i in (0, 1)]
        assert all(s["state"] == "new" for s in plan["steps"]) and plan["kept"] == 0
        assert plan["to_run"] == len(plan["steps"])
    assert len(plans["qwen-1.5b-1gpu"]["steps"]) == 4 * 3  # each training, then its aime24 and aime25 evaluations
    assert {s["step"] for s in plans["tiny-cpu"]["steps"]} == {"train"}  # a local job ends with its own evaluation
