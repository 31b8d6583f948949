"""Broken state: resume refuses what it cannot continue, in one line naming the file or the setting
(exit 2, nothing changed); a cut last line is dropped and redone with one warning; a run that fails before its
first checkpoint leaves nothing that blocks the corrected retry."""
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stare.cli import rundir
from stare.cli.main import app
from stare.cli.presets import resolve
from stare.cli.rundir import RunDirError, check_resumable, prepare_run_dir
from stare.eval import harness, protocols, record
from stare.eval.data import Problem
from tiny_models import PROBLEMS, write_problems

runner = CliRunner()
SETS = ["steps=3", "save_every=2", "warmstart_steps=5", "eval_problems=4", "eval_k=2", "prompts_per_step=2",
        "samples_per_prompt=2", "train_problems=50", "micro_batch_size=4"]


def invoke(*args):
    return runner.invoke(app, list(args), terminal_width=200)


def one_line(res) -> str:
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr, res.exception)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr and lines[0].startswith("error: "), res.stderr
    return lines[0]


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")}


def train_args(out):
    return ["train", "--preset", "tiny-cpu", "--algo", "grpo", "--out", str(out), *sum((["--set", s] for s in SETS), [])]


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A tiny run stopped after step 2 (its checkpoint); metrics.jsonl holds steps 1 and 2."""
    from stare.cli.local.trainer import LocalTrainer

    out = tmp_path_factory.mktemp("killed") / "run"
    resolved = resolve("tiny-cpu", "grpo", SETS)
    prepare_run_dir(out, resolved, False)

    def stop(step, steps, rec):
        if step == 2:
            raise Stop

    with pytest.raises(Stop):
        LocalTrainer(resolved, out).run(on_step=stop)
    assert (out / "checkpoint" / "trainer_state.pt").exists()
    return out


@pytest.fixture
def run_copy(killed_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(killed_run, out)
    return out


def test_a_cut_last_metrics_line_is_dropped_and_redone_with_one_warning(run_copy, capfd):
    with open(run_copy / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward_me')  # a kill during the write of step 3's line
    check_resumable(run_copy)  # the cut last line is not an error
    res = invoke(*train_args(run_copy), "--resume")
    assert res.exit_code == 0, (res.stderr, res.exception)
    warned = capfd.readouterr().err + res.stderr
    assert warned.count("the last line was cut") == 1, warned
    steps = [json.loads(x)["step"] for x in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_a_corrupt_metrics_line_before_the_last_is_one_line_naming_it(run_copy):
    path = run_copy / "metrics.jsonl"
    rows = path.read_text().splitlines()
    path.write_text("{garbage\n" + "\n".join(rows[1:]) + "\n")
    before = tree(run_copy)
    line = one_line(invoke(*train_args(run_copy), "--resume"))
    assert f"{path} line 1 is corrupt" in line, line
    assert tree(run_copy) == before


@pytest.mark.parametrize("name", ["model.safetensors", "trainer_state.pt"])
def test_a_truncated_checkpoint_file_is_one_line_naming_it(run_copy, name):
    path = run_copy / "checkpoint" / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    before = tree(run_copy)
    line = one_line(invoke(*train_args(run_copy), "--resume"))
    assert str(path) in line and "cut short" in line and "cannot be resumed" in line, line
    assert f"remove {run_copy / 'checkpoint'}" in line  # the way on, since no earlier checkpoint is kept
    assert tree(run_copy) == before


def test_an_earlier_checkpoint_kept_is_named_as_the_way_to_resume(run_copy):
    shutil.copytree(run_copy / "checkpoint", run_copy / "checkpoint.old")  # a save cut between its renames
    state = run_copy / "checkpoint" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(RunDirError, match=r"an earlier checkpoint is kept: rename .*checkpoint\.old"):
        check_resumable(run_copy)
    shutil.rmtree(run_copy / "checkpoint")
    with pytest.raises(RunDirError, match="is missing .*rename"):
        check_resumable(run_copy)


def test_checkpoint_checks_read_headers_only(tmp_path):
    f = tmp_path / "w.safetensors"
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    f.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    assert rundir.safetensors_problem(f) is None
    f.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 7)
    assert "cut short" in rundir.safetensors_problem(f)
    f.write_bytes(b"\xff" * 8 + b"{}")
    assert "cut short" in rundir.safetensors_problem(f)


def test_a_new_run_failing_before_its_first_checkpoint_leaves_nothing(tmp_path, monkeypatch):
    from stare.cli.local import trainer

    def boom(self, **kw):
        (self.run_dir / "metrics.jsonl").write_text("")
        raise RuntimeError("planted failure")

    monkeypatch.setattr(trainer.LocalTrainer, "run", boom)
    out = tmp_path / "run"
    res = invoke(*train_args(out))
    assert isinstance(res.exception, RuntimeError)
    assert not out.exists()  # config.yaml and metrics.jsonl gone: the corrected retry is not refused
    (tmp_path / "empty").mkdir()
    res = invoke(*train_args(tmp_path / "empty"))
    assert isinstance(res.exception, RuntimeError)
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())  # the user's folder stays


# --- stare eval --resume ---------------------------------------------------------------------------------

class Scripted:
    name = "scripted"

    def prompt_text(self, problem, instruction):
        return problem

    def generate(self, prompt, n, proto, seed):
        return [("\\boxed{2}", 3) for _ in range(n)]


@pytest.fixture
def evaluated(tmp_path):
    """An output folder evaluated with k 2, temperature 1.0, seed 0 (the stare protocol) on a local data file."""
    data = write_problems(tmp_path / "mini.jsonl", PROBLEMS)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "out"
    problems = [Problem(r["id"], r["problem"], r["answer"]) for r in PROBLEMS]
    proto = protocols.resolve_protocol("stare", k=2, max_tokens=8)
    harness.run_eval(problems, Scripted(), proto, out, bench="aime24", model=str(model), seed=0, resume=False,
                     data=str(data.resolve()))
    return out, model, data


@pytest.mark.parametrize("extra, named", [
    (["--k", "3"], "--k 3: {out} holds samples drawn with k 2"),
    (["--temperature", "0.6", "--seed", "7"], "--temperature 0.6: {out} holds samples drawn with temperature 1.0"),
    (["--seed", "7"], "--seed 7: {out} holds samples drawn with seed 0"),
    (["--top-p", "0.9"], "--top-p 0.9: {out} holds samples drawn with top_p 0.7"),
    (["--max-tokens", "9"], "--max-tokens 9: {out} holds samples drawn with max_tokens 8"),
    (["--protocol", "dapo"], "--protocol dapo: {out} holds samples drawn with protocol stare"),
    (["--model", "OTHER"], "--model {other}: {out} holds samples drawn with model {model}"),
    (["--data-file", "OTHERDATA"], "--data-file {otherdata}: {out} holds samples drawn with data {data}"),
])
def test_eval_resume_with_other_settings_is_refused_naming_the_setting(evaluated, tmp_path, extra, named):
    out, model, data = evaluated
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    otherdata = write_problems(tmp_path / "other.jsonl", PROBLEMS)
    args = {"--model": str(model), "--data-file": str(data), "--k": "2", "--max-tokens": "8"}
    for flag, value in zip(extra[::2], extra[1::2]):
        args[flag] = {"OTHER": str(other), "OTHERDATA": str(otherdata)}.get(value, value)
    before = tree(out)
    line = one_line(invoke("eval", "--bench", "aime24", "--backend", "hf", "--out", str(out), "--resume",
                           *sum(([k, v] for k, v in args.items()), [])))
    want = named.format(out=out, model=model.resolve(), other=other.resolve(), data=data.resolve(),
                        otherdata=otherdata.resolve())
    assert want in line and "resume with the same settings" in line, line
    assert tree(out) == before


def test_eval_resume_with_other_bench_is_refused(evaluated):
    out, model, data = evaluated
    with pytest.raises(record.EvalRefused, match="--bench aime25: .* bench aime24"):
        rec = json.loads((out / record.RECORD).read_text())
        record.check_resume(out, {**rec, "bench": "aime25"})


def test_a_folder_from_before_the_record_is_checked_against_its_summary_and_samples(evaluated):
    out, model, data = evaluated
    rec = json.loads((out / record.RECORD).read_text())
    (out / record.RECORD).unlink()
    with pytest.raises(record.EvalRefused, match="--k 3: .*with k 2"):
        record.check_resume(out, {**rec, "k": 3})  # from summary.json
    # such a folder was drawn one problem at a time: resumed with that mode, refused with another
    with pytest.raises(record.EvalRefused, match="--batching all: .*with batching problem"):
        record.check_resume(out, {**rec, "batching": "all"})
    (out / "summary.json").unlink()
    with pytest.raises(record.EvalRefused, match="--k 3: .*with k 2"):
        record.check_resume(out, {**rec, "k": 3})  # from the samples' indices
    with pytest.raises(record.EvalRefused, match="--batching all: .*with batching problem"):
        record.check_resume(out, {**rec, "batching": "all"})
    assert record.recorded_batching(out) == "problem"
    record.check_resume(out, {**rec, "batching": "problem"})


def test_a_cut_last_samples_line_is_dropped_with_one_warning_and_redone(evaluated):
    out, model, data = evaluated
    path = out / "samples.jsonl"
    full = path.read_text()
    path.write_text(full[: len(full) - 20])  # the last sample's line cut by a kill
    warnings = []
    done = record.read_done(path, 2, warnings.append)
    assert len(warnings) == 1 and "the last line was cut" in warnings[0]
    assert len(done) == len(PROBLEMS) - 1  # the cut problem is redone
    problems = [Problem(r["id"], r["problem"], r["answer"]) for r in PROBLEMS]
    harness.run_eval(problems, Scripted(), protocols.resolve_protocol("stare", k=2, max_tokens=8), out,
                     bench="aime24", model=str(model), seed=0, resume=True, data=str(data.resolve()),
                     warn=warnings.append)
    assert path.read_text() == full


def test_a_corrupt_samples_line_before_the_last_is_one_line_naming_it(evaluated):
    out, model, data = evaluated
    path = out / "samples.jsonl"
    rows = path.read_text().splitlines()
    path.write_text("\n".join([rows[0], "{not json", *rows[2:]]) + "\n")
    before = tree(out)
    line = one_line(invoke("eval", "--bench", "aime24", "--backend", "hf", "--out", str(out), "--resume",
                           "--model", str(model), "--data-file", str(data), "--k", "2", "--max-tokens", "8"))
    assert f"{path} line 2 is corrupt" in line, line
    assert tree(out) == before


class ShortContext(Scripted):
    context_length = 4

    def prompt_tokens(self, prompt):
        return len(prompt)


def test_a_model_whose_context_fits_no_problem_is_refused_before_writing(tmp_path):
    problems = [Problem(r["id"], r["problem"], r["answer"]) for r in PROBLEMS]
    with pytest.raises(record.EvalRefused, match=r"--model m: its context of 4 tokens fits no problem \(the "
                                                 r"shortest prompt has \d+ tokens\)"):
        harness.run_eval(problems, ShortContext(), protocols.resolve_protocol("stare", k=1), tmp_path / "o",
                         bench="aime24", model="m", seed=0, resume=False)
    assert not (tmp_path / "o").exists()
