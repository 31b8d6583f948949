"""The stare command line: presets, algos, train validation; and the package's import namespace."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stare.algorithms import ALGORITHMS
from stare.cli.main import app
from stare.cli.presets import PresetError, parse_preset, preset_names, resolve

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]


def run_stare(*args):
    """The real console entry point in a fresh interpreter (what a user's shell runs)."""
    return subprocess.run([sys.executable, "-c", "from stare.cli.main import main; main()", *args],
                          capture_output=True, text=True, cwd="/")


def test_version_and_help():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("stare ")
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    for cmd in ("presets", "algos", "train"):
        assert cmd in res.output


def test_algos_lists_every_algorithm_with_the_entropy_baselines_and_their_papers():
    res = runner.invoke(app, ["algos"], terminal_width=400)
    assert res.exit_code == 0, res.output
    rows = {line.split("│")[1].strip(): line for line in res.output.splitlines() if line.count("│") == 3}
    assert [n for n in rows if n in ALGORITHMS] == list(ALGORITHMS)
    assert {"clip-cov", "kl-cov", "80-20"} <= set(rows)
    assert "Cui et al." in rows["clip-cov"] and "Cui et al." in rows["kl-cov"] and "Wang et al." in rows["80-20"]


def test_presets_lists_every_yaml_with_description():
    files = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    assert preset_names() == files and "tiny-cpu" in files
    res = runner.invoke(app, ["presets"], terminal_width=200)
    assert res.exit_code == 0
    for name in files:
        assert name in res.output
    assert "Embedded CPU default" in res.output


@pytest.mark.parametrize("args, bad, valid", [
    (["--preset", "nope"], "'nope'", "tiny-cpu"),
    (["--preset", "tiny-cpu", "--algo", "ppo"], "'ppo'", "stare-phi"),
    (["--preset", "tiny-cpu", "--set", "colour=red"], "'colour'", "top_ratio"),
    (["--preset", "tiny-cpu", "--set", "w=heavy"], "w=heavy", "float"),
    (["--preset", "tiny-cpu", "--set", "steps=1.5"], "steps=1.5", "int"),
    (["--preset", "tiny-cpu", "--set", "target_entropy=-1"], "target_entropy", "(0"),
    (["--preset", "tiny-cpu", "--set", "novalue"], "'novalue'", "key=value"),
])
def test_train_bad_input_is_one_line_exit_2(args, bad, valid):
    res = run_stare("train", *args, "--dry-run")
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert bad in lines[0] and valid in lines[0]


def test_train_dry_run_resolves_overrides():
    res = runner.invoke(app, ["train", "--preset", "tiny-cpu", "--algo", "stare-c2", "--set", "w=1.5",
                              "--set", "steps=7", "--set", "lr=1e-4", "--set", "dual_clip=null", "--dry-run"])
    assert res.exit_code == 0, res.output
    cfg = json.loads(res.stdout)
    assert cfg["algo"]["name"] == "stare-c2" and cfg["algo"]["w"] == 1.5 and cfg["algo"]["dual_clip"] is None
    assert cfg["settings"]["steps"] == 7 and cfg["settings"]["lr"] == 1e-4
    assert cfg["backend"] == "local"


def test_every_preset_resolves_with_every_algorithm():
    from stare.algorithms import ALGORITHMS
    for name in preset_names():
        for algo in ALGORITHMS:
            assert resolve(name, algo)["algo"]["name"] == algo


GOOD = "name: x\ndescription: d\nbackend: local\nsettings: {steps: 3}\n"


@pytest.mark.parametrize("text, pattern", [
    ("description: d\nbackend: local\nsettings: {}\n", "missing the field 'name'"),
    ("name: x\ndescription: 5\nbackend: local\nsettings: {}\n", "'description' must be a str"),
    (GOOD.replace("local", "slurm"), "unknown backend 'slurm'; valid backends: local, openrlhf"),
    (GOOD + "colour: red\n", "unknown field 'colour'"),
    (GOOD + "algorithms: {ppo: {}}\n", "unknown algorithm 'ppo'"),
    (GOOD + "algorithms: {stare: {w: -1}}\n", "algorithms.stare: w must be"),
    (GOOD.replace("{steps: 3}", "{w: 3}"), "'w' is an algorithm setting"),
    ("name: [\n", "not valid YAML"),
])
def test_preset_file_validation(text, pattern):
    with pytest.raises(PresetError, match=pattern):
        parse_preset(text, source="x.yaml", expected_name="x")


def test_one_namespace_nothing_generic_at_top_level(tmp_path):
    code = ("import importlib.util as u, json;"
            "print(json.dumps([u.find_spec(n) is not None for n in ('algorithms', 'eval', 'configs', 'stare_cli', "
            "'stare.algorithms', 'stare.eval', 'stare.cli', 'stare.configs')]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert json.loads(out.stdout) == [False] * 4 + [True] * 4
    from importlib import resources
    assert resources.files("stare.configs").joinpath("tiny-cpu.yaml").is_file()


def test_algorithms_import_no_engine():
    code = ("import sys, stare.algorithms;"
            "print(sorted(m for m in ('openrlhf', 'ray', 'vllm', 'deepspeed', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
