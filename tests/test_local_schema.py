"""The local presets' typed schema (stare_cli/local_schema.py): checked on load, after --set, by --dry-run; the
table `stare algos --settings` and docs/local-settings.md render from."""
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stare.cli import local_schema, settings_doc
from stare.cli.local_schema import LOCAL_SETTINGS, SCHEMA, check_local_settings
from stare.cli.main import app
from stare.cli.presets import PresetError, load_preset, parse_preset, preset_names, resolve

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def one_line(res) -> str:
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr, res.exception)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr and lines[0].startswith("error: "), res.stderr
    return lines[0]


LOCAL = [n for n in preset_names() if load_preset(n).backend == "local"]


def test_every_shipped_local_preset_fits_the_schema():
    import yaml

    assert set(LOCAL) >= {"tiny-cpu", "tiny-explore", "smollm-cpu"}
    for name in LOCAL:
        raw = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())["settings"]
        assert set(raw) <= set(SCHEMA), set(raw) - set(SCHEMA)
        loaded = load_preset(name).settings
        assert list(loaded) == [s.name for s in LOCAL_SETTINGS]  # every setting, defaults filled in
        assert all(loaded[k] == v for k, v in raw.items())


def test_the_schema_names_what_the_engine_accepts():
    from stare.cli.local import device, tasks

    import torch

    for name in SCHEMA["device"].choices:  # each choice is one the engine resolves (cuda: here, or refused)
        if name == "cuda" and not torch.cuda.is_available():
            with pytest.raises(device.DeviceError, match="no GPU is visible"):
                device.engine_device({"device": name})
        else:
            assert device.engine_device({"device": name}).type in ("cpu", "cuda")
    assert all(tasks.get_task(name).name == name for name in SCHEMA["task"].choices)  # each choice builds its task
    assert set(SCHEMA["task"].choices) == set(tasks.TASKS)  # and the engine has no task the setting cannot name
    # what `stare algos --settings` shows for the local scope: every local setting, with its own meaning
    from typer.testing import CliRunner

    from stare.cli.main import app

    out = CliRunner().invoke(app, ["algos", "--settings"], terminal_width=400).stdout
    local = out[out.index("run settings of the local presets"):out.index("run settings of the GPU presets")]
    rows = {}
    for line in local.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) > 3 and cells[1]:
            rows[cells[1]] = cells[3]  # a setting's row: name, default, the first line of its meaning
    assert sorted(rows) == sorted(s.name for s in LOCAL_SETTINGS)
    for s in LOCAL_SETTINGS:  # the shown line and the setting's meaning agree as far as both go
        shown = rows[s.name]
        assert shown and shown[:len(s.help)] == s.help[:len(shown)], (s.name, shown)
    assert all(s.help and s.valid() for s in LOCAL_SETTINGS)
    assert all(s.problem(s.default) is None for s in LOCAL_SETTINGS)  # every default is valid
    assert SCHEMA["steps"].problem(0) and SCHEMA["lr"].problem(-0.1) and SCHEMA["task"].problem("sort")


@pytest.mark.parametrize("item, named, valid", [
    ("steps=0", "--set steps=0", "integer >= 1"),
    ("steps=-5", "--set steps=-5", "integer >= 1"),
    ("lr=-0.1", "--set lr=-0.1", "number > 0"),
    ("task=sort", "--set task=sort", "valid choices: reverse, explore, arith"),
    ("device=tpu", "--set device=tpu", "valid choices: auto, cpu, cuda"),
    ("temperature=0", "--set temperature=0", "number in (0, 2]"),
    ("warmstart_noise=1.5", "--set warmstart_noise=1.5", "number in [0, 1]"),
    ("hidden=30", "--set hidden=30", "multiple of 4"),
    ("samples_per_prompt=1", "--set samples_per_prompt=1", "integer >= 2"),
    ("steps=1.5", "--set steps=1.5", "integer >= 1, got float 1.5"),
    ("lr=fast", "--set lr=fast", "number > 0, got str 'fast'"),
    ("lr=.inf", "--set lr=.inf", "finite"),
    ("same_batch_entropy=maybe", "--set same_batch_entropy=maybe", "true or false"),
    ("algos=grpo,nope", "--set algos=grpo,nope", "unknown algorithm 'nope'"),
    ("prompts_per_step=5000", "--set prompts_per_step=5000", "must be <= train_problems (4000)"),
])
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_bad_local_setting_is_one_line_before_anything_is_written(tmp_path, item, named, valid, dry_run):
    out = tmp_path / "run"
    args = ["train", "--preset", "tiny-cpu", "--algo", "grpo", "--set", item, "--out", str(out)]
    line = one_line(runner.invoke(app, args + (["--dry-run"] if dry_run else [])))
    assert named in line and valid in line, line
    assert not out.exists()


def test_the_corrected_retry_runs_in_the_same_out(tmp_path):
    """A run refused for task=sort leaves no folder behind, so the corrected retry in the same --out runs."""
    out = tmp_path / "run"
    one_line(runner.invoke(app, ["train", "--preset", "tiny-cpu", "--set", "task=sort", "--out", str(out)]))
    assert not out.exists()
    res = runner.invoke(app, ["train", "--preset", "tiny-cpu", "--set", "task=explore", "--out", str(out),
                              "--dry-run"])
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("line, message", [
    ("steps: 0", "setting steps: expected integer >= 1, got 0"),
    ("lr: -0.1", "setting lr: expected number > 0, got -0.1"),
    ("task: sort", "setting task: unknown value 'sort'"),
    ("stepz: 3", "unknown setting 'stepz'; valid settings: task, model,"),
    ("steps: '200'", "setting steps: expected integer >= 1, got str '200'"),
])
def test_a_preset_file_with_a_bad_setting_is_refused_on_load(line, message):
    text = f"name: t\ndescription: d\nbackend: local\nsettings:\n  task: reverse\n  {line}\n"
    with pytest.raises(PresetError) as info:
        parse_preset(text, source="t.yaml")
    assert str(info.value).startswith("preset t.yaml: ") and message in str(info.value), str(info.value)


def test_valid_values_pass_and_are_typed():
    s = resolve("tiny-cpu", "grpo", ["steps=3", "lr=1e-4", "temperature=2", "warmstart_noise=0", "task=explore"])
    assert s["settings"]["steps"] == 3 and s["settings"]["lr"] == 1e-4 and s["settings"]["task"] == "explore"
    assert isinstance(s["settings"]["temperature"], float)
    with pytest.raises(ValueError, match="unknown setting 'nope'"):
        check_local_settings({"nope": 1}, "")


def test_docs_table_is_rendered_from_the_schema():
    doc = (ROOT / "docs" / "local-settings.md").read_text()
    assert doc == settings_doc.local_settings_markdown(), \
        "regenerate: python -m stare.cli.settings_doc > docs/local-settings.md"
    for s in LOCAL_SETTINGS:
        assert f"| `{s.name}` | {s.type.__name__} |" in doc
