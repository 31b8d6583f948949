"""Run-folder ownership (stare.cli.rundir) and eval planning (stare.cli.eval_plan), outside the CLI's code."""
import subprocess
import sys

import pytest
import yaml

from stare.cli.eval_plan import check_harness, check_model_folder, eval_target
from stare.cli.rundir import RunDirError, check_run_dir, check_run_set_dir, final_model, mark_run_set


def stare(*args):
    return subprocess.run([sys.executable, "-m", "stare.cli.main", *args], capture_output=True, text=True)


def test_eval_target_takes_a_training_runs_final_model(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ValueError, match="--model is required"):
        eval_target(None, run, "aime24")  # no config.yaml, no final/
    (run / "config.yaml").write_text("preset: tiny-cpu\n")
    (run / "final").mkdir()
    assert final_model(run) is None  # final/ without a model config: not finished
    (run / "final" / "config.json").write_text("{}")
    assert eval_target(None, run, "aime24") == (str(run / "final"), run / "eval-aime24")
    assert eval_target("owner/name", None, "aime25") == ("owner/name", tmp_path.__class__("evals") / "aime25")
    with pytest.raises(ValueError, match="no such folder .*and not a hub id"):
        eval_target("runs/tiny/stare/final", None, "aime24")
    # an absolute path that is missing is a missing folder, not a hub id to ask for
    with pytest.raises(ValueError, match=r"--model '/nonexistent': no such folder \(/nonexistent\)"):
        eval_target("/nonexistent", None, "aime24")
    readme = tmp_path / "README.md"
    readme.write_text("# not a model\n")
    with pytest.raises(ValueError, match="is a file; expected a model folder"):
        check_model_folder(str(readme))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json that is not valid JSON"):
        check_model_folder(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="folder without config.json"):
        check_model_folder(str(tmp_path))
    check_model_folder(str(run / "final"))  # a model folder passes
    assert eval_target(str(run / "final"), tmp_path / "o", "aime24") == (str(run / "final"), tmp_path / "o")


def test_check_harness_combinations():
    for harness, kw, message in [("helm", {}, "unknown harness 'helm'; valid harnesses: stare, lm-eval"),
                                 ("stare", {"tools": "bash"}, "unknown tool 'bash'"),
                                 ("lm-eval", {"tools": "python"}, "--tools works with --harness stare only")]:
        with pytest.raises(ValueError, match=message):
            check_harness(harness, "aime24", resume=kw.get("resume", False), tools=kw.get("tools"))
    check_harness("stare", "math500", resume=True, tools="python")  # fine


def test_run_set_folder_ownership(tmp_path):
    out = tmp_path / "runs"
    check_run_set_dir(out, "tiny-cpu")  # a new folder
    mark_run_set(out, "tiny-cpu", ["grpo", "stare"], 2)
    assert yaml.safe_load((out / "run.yaml").read_text()) == {"preset": "tiny-cpu", "algos": ["grpo", "stare"],
                                                               "seeds": 2}
    check_run_set_dir(out, "tiny-cpu")  # the same preset: resumable
    with pytest.raises(RunDirError, match="holds a run of preset 'tiny-cpu'"):
        check_run_set_dir(out, "tiny-explore")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    with pytest.raises(RunDirError, match="is not empty and holds no stare run"):
        check_run_set_dir(other, "tiny-cpu")


def test_a_broken_marker_or_config_is_one_line_exit_2(tmp_path):
    """A run.yaml / config.yaml that is not YAML: one line naming the file, not a yaml traceback."""
    out = tmp_path / "runs"
    out.mkdir()
    (out / "run.yaml").write_text("preset: [unclosed\n")
    res = stare("run", "--preset", "tiny-cpu", "--out", str(out))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "run.yaml is not valid YAML" in lines[0]
    run = tmp_path / "one"
    run.mkdir()
    (run / "config.yaml").write_text("algo: [unclosed\n")
    with pytest.raises(RunDirError, match="config.yaml is not valid YAML"):
        check_run_dir(run, {"preset": "tiny-cpu", "algo": {"name": "grpo"}}, True)


def test_a_folder_from_before_an_algorithm_setting_existed_resumes(tmp_path):
    """A run's config.yaml written before dg_eta and steer_* were settings (its algo section lacks them) resumes with
    today's resolved config, whose values there are their defaults; a changed value, old or new, is still refused."""
    from stare.cli.presets import resolve

    resolved = resolve("tiny-cpu", "grpo", [])
    old = yaml.safe_load(yaml.safe_dump(resolved, sort_keys=False))
    for key in ("dg_eta", "steer_mapping", "steer_weight_min", "steer_weight_max"):
        del old["algo"][key]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    assert check_run_dir(tmp_path, resolved, resume=True) is True
    with pytest.raises(RunDirError, match="was started with other settings") as err:
        check_run_dir(tmp_path, resolve("tiny-cpu", "grpo", ["clip_high=0.3"]), resume=True)
    clip = resolved["algo"]["clip_high"]
    assert f"(algo.clip_high: was {clip!r}, now 0.3)" in str(err.value)  # the key that differs, both values
    old["algo"]["dg_eta"] = 2.0  # a folder that names a value other than the default keeps it
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    with pytest.raises(RunDirError, match="was started with other settings") as err:
        check_run_dir(tmp_path, resolved, resume=True)
    assert "algo.dg_eta: was 2.0, now " in str(err.value)


def test_settings_changed_names_each_differing_key_and_counts_the_rest():
    from stare.cli.rundir import settings_changed

    old = {"settings": {"lr": 0.1, "steps": 5, "a": 1, "b": 2}, "algo": {"name": "grpo"}}
    new = {"settings": {"lr": 0.2, "steps": 5, "a": 3, "b": 4, "c": 5}, "algo": {"name": "grpo"}}
    assert settings_changed(old, old) == ""
    assert settings_changed(old, new) == ("settings.a: was 1, now 3; settings.b: was 2, now 4; settings.c: was "
                                          "unset, now 5; and 1 more")
    assert settings_changed(old, new, most=9).endswith("settings.lr: was 0.1, now 0.2")
