"""Presets of one's own (`--preset PATH.yaml`, `stare presets --show`), and the messages for a file that is not
UTF-8 and for a model that is neither a folder nor a cached hub model."""
from __future__ import annotations

import hashlib
import json

import pytest
import yaml
from typer.testing import CliRunner

from stare.cli.main import app

runner = CliRunner()
# a local run that takes seconds (the same sizes as the CLI progress test)
SMALL = {"steps": 3, "warmstart_steps": 5, "eval_problems": 4, "prompts_per_step": 4, "samples_per_prompt": 4,
         "train_problems": 50}


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], terminal_width=200)


def one_line(res) -> str:
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (res.exit_code, res.stderr)
    assert "Traceback" not in res.stderr and not res.stdout, res.output
    return lines[0]


def dry_run(*args) -> dict:
    res = invoke("train", *args, "--dry-run")
    assert res.exit_code == 0, (res.stdout, res.stderr)
    return json.loads(res.stdout)


def metrics(run) -> list[dict]:
    """A run's metrics.jsonl less its timings (the only values that differ between two identical runs)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == SMALL["steps"]
    return [{k: v for k, v in r.items() if "time" not in k} for r in rows]


def test_a_preset_file_on_a_shipped_base_trains_as_the_base_with_the_same_sets(tmp_path):
    """A file outside the package (`base: tiny-cpu` and settings) trains a real local run to the same metrics as
    the shipped preset with the same values given by --set; the run's config.yaml records the file's path and the
    SHA-256 of its bytes, and the default run folder is named after the file."""
    mine = tmp_path / "mine" / "small.yaml"
    mine.parent.mkdir()
    mine.write_text("base: tiny-cpu\ndescription: tiny-cpu, a few steps\nsettings:\n"
                    + "".join(f"  {k}: {v}\n" for k, v in SMALL.items()))
    res = invoke("train", "--preset", mine, "--algo", "grpo", "--out", tmp_path / "from-file")
    assert res.exit_code == 0, (res.stdout, res.stderr)
    sets = sum((["--set", f"{k}={v}"] for k, v in SMALL.items()), [])
    res = invoke("train", "--preset", "tiny-cpu", "--algo", "grpo", "--out", tmp_path / "from-sets", *sets)
    assert res.exit_code == 0, (res.stdout, res.stderr)
    assert metrics(tmp_path / "from-file") == metrics(tmp_path / "from-sets")
    config = yaml.safe_load((tmp_path / "from-file" / "config.yaml").read_text())
    assert config["preset"] == "small"
    assert config["preset_file"] == {"path": str(mine.absolute()), "sha256": hashlib.sha256(mine.read_bytes()).hexdigest()}
    mine.write_text(mine.read_text() + "# a comment: the settings are the same, the run still resumes\n")
    res = invoke("train", "--preset", mine, "--algo", "grpo", "--out", tmp_path / "from-file", "--resume")
    assert res.exit_code == 0, (res.stdout, res.stderr)
    mine.write_text(mine.read_text().replace("steps: 3", "steps: 4"))
    assert "was started with other settings" in one_line(
        invoke("train", "--preset", mine, "--algo", "grpo", "--out", tmp_path / "from-file", "--resume"))
    plan = dry_run("--preset", mine, "--algo", "grpo")
    assert plan["preset"] == "small" and plan["settings"]["steps"] == 4


def test_a_gpu_preset_file_gives_the_dry_run_of_the_base_with_the_same_sets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "q7.yaml"
    mine.write_text("base: qwen-7b-short-cot\nsettings:\n  lr: 2.0e-6\n  episodes: 3\nalgorithms:\n  stare: {w: 1.3}\n")
    got = dry_run("--preset", "./q7.yaml", "--algo", "stare", "--out", "run")
    want = dry_run("--preset", "qwen-7b-short-cot", "--algo", "stare", "--out", "run", "--set", "lr=2e-6",
                   "--set", "episodes=3", "--set", "w=1.3")
    assert got["preset"] == "q7" and want["preset"] == "qwen-7b-short-cot"
    # the same OpenRLHF command but for the run's name, which is the preset's
    text = json.dumps(got).replace("q7-stare", "qwen-7b-short-cot-stare").replace('"preset": "q7"',
                                                                                 '"preset": "qwen-7b-short-cot"')
    assert json.loads(text) == want
    assert got["openrlhf_argv"][got["openrlhf_argv"].index("--actor.adam.lr") + 1] == "2e-06"


@pytest.mark.parametrize("preset, algo", [("tiny-cpu", "stare"), ("qwen-7b-short-cot", "stare"),
                                          ("smollm-cpu", "dapo")])
def test_show_round_trips(tmp_path, monkeypatch, preset, algo):
    """`stare presets --show NAME` prints the shipped file byte for byte; saved elsewhere under another name and
    passed back, it gives the shipped preset's dry run."""
    monkeypatch.chdir(tmp_path)
    res = invoke("presets", "--show", preset)
    assert res.exit_code == 0, res.stderr
    from importlib import resources

    assert res.stdout == resources.files("stare.configs").joinpath(f"{preset}.yaml").read_text()
    (tmp_path / "copy.yaml").write_text(res.stdout)
    assert dry_run("--preset", tmp_path / "copy.yaml", "--algo", algo, "--out", "r") == dry_run(
        "--preset", preset, "--algo", algo, "--out", "r") | ({"preset_file": {
            "path": str(tmp_path / "copy.yaml"),
            "sha256": hashlib.sha256(res.stdout.encode()).hexdigest()}} if preset != "qwen-7b-short-cot" else {})


def test_presets_says_where_shipped_presets_live_and_that_a_path_works():
    from importlib import resources

    res = invoke("presets")
    assert res.exit_code == 0
    assert str(resources.files("stare.configs")) in res.stdout.replace("\n", "")
    assert "--preset also takes a path to a preset YAML file" in res.stdout.replace("\n", " ")
    line = one_line(invoke("presets", "--show", "nope"))
    assert "unknown preset 'nope'" in line and "tiny-cpu" in line


BAD_FILES = {  # file text -> what the one line says (after the file's path)
    "- a list\n": "must be a mapping of fields, got list",
    "base: tiny-cpu\nbogus: 1\n": "has unknown field 'bogus'; valid fields: name, description, backend, settings, "
                                  "algorithms, base",
    "base: nope\n": "base 'nope' is not a shipped preset; valid bases:",
    "base: ./other.yaml\n": "base './other.yaml' is not a shipped preset",
    "base: tiny-cpu\nsettings: {steps: 0}\n": "steps",
    "base: tiny-cpu\nsettings: [1]\n": "field 'settings' must be a mapping, got list",
    "base: tiny-cpu\nbackend: openrlhf\n": "backend 'openrlhf' differs from its base's ('local')",
    "base: tiny-cpu\nname: 'a b'\n": "name 'a b' must be letters, digits",
    "base: tiny-cpu\nalgorithms: {nope: {}}\n": "unknown algorithm 'nope'",
    "base: tiny-cpu\nalgorithms: {stare: {w: -1}}\n": "algorithms.stare",
    "base: qwen-7b-short-cot\nsettings: {zero_stage: 4}\n": "zero_stage",
    "name: x\nbackend: local\n": "is missing the field 'description'",
    "a: [\n": "is not valid YAML",
    "base: tiny-cpu\nsettings:\n  steps: [1, 2\n  seed: 3\n": "is not valid YAML at line 4, column 7: while parsing a "
                                                            "flow sequence; expected ',' or ']', but got ':'",
}


@pytest.mark.parametrize("text", list(BAD_FILES))
def test_a_bad_preset_file_is_one_line_naming_the_file(tmp_path, text):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    for args in (["train", "--preset", path, "--algo", "stare", "--dry-run"],
                 ["train", "--preset", path, "--algo", "stare", "--out", tmp_path / "run"]):
        line = one_line(invoke(*args))
        assert str(path) in line and BAD_FILES[text] in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]  # nothing written


def test_a_missing_preset_file_or_a_folder_is_one_line(tmp_path):
    assert one_line(invoke("train", "--preset", tmp_path / "no.yaml", "--dry-run")) == \
        f"error: preset file not found: {tmp_path / 'no.yaml'}"
    (tmp_path / "d.yaml").mkdir()
    assert "is a folder" in one_line(invoke("run", "--preset", tmp_path / "d.yaml"))


# ---- bytes that are not UTF-8: the file, the line and the column -------------------------------------------------

BAD_BYTES = b'{"id": "p1", "problem": "What is 1+1?", "answer": "2"}\n{"id": "p2", \xff"problem": "x", "answer": "3"}\n'
WANT = "not UTF-8 text (byte 0xff at column 14); save the file as UTF-8"  # line 2, after `{"id": "p2", `


def test_a_preset_file_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "u.yaml"
    path.write_bytes(b"base: tiny-cpu\ndescription: caf\xe9\n")
    assert one_line(invoke("train", "--preset", path, "--dry-run")) == \
        f"error: {path}:2: not UTF-8 text (byte 0xe9 at column 17); save the file as UTF-8"


def test_problem_files_that_are_not_utf8_name_the_line(tmp_path):
    from stare.cli.openrlhf_backend.data import prepare_prompts
    from stare.eval.data import load_bench

    path = tmp_path / "p.jsonl"
    path.write_bytes(BAD_BYTES)
    assert BAD_BYTES.split(b"\n")[1].index(b"\xff") + 1 == 14  # the column, counted here on its own
    with pytest.raises(ValueError) as exc:
        load_bench("aime25", data_file=path)
    assert str(exc.value) == f"{path}:2: {WANT}"
    with pytest.raises(ValueError) as exc:
        prepare_prompts(str(path), "{problem}", tmp_path / "out.jsonl")
    assert str(exc.value) == f"{path}:2: {WANT}"
    json_path = tmp_path / "p.json"
    json_path.write_bytes(b'[\n {"problem": "\xc3(", "answer": "1"}\n]\n')
    with pytest.raises(ValueError) as exc:
        prepare_prompts(str(json_path), "{problem}", tmp_path / "out.jsonl")
    assert str(exc.value) == f"{json_path}:2: not UTF-8 text (byte 0xc3 at column 15); save the file as UTF-8"


def test_eval_data_file_that_is_not_utf8_is_one_line(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    path = tmp_path / "p.jsonl"
    path.write_bytes(BAD_BYTES)
    line = one_line(invoke("eval", "--bench", "aime25", "--model", tmp_path / "model", "--data-file", path,
                           "--out", tmp_path / "ev"))
    assert line == f"error: {path}:2: {WANT}"
    assert not (tmp_path / "ev").exists()


# ---- a model that is neither a folder here nor a cached hub model -------------------------------------------------


@pytest.mark.parametrize("model", ["gpt2", "someone/some-model"])
def test_an_offline_model_that_is_nowhere_says_what_was_looked_for(tmp_path, monkeypatch, model):
    """Single-name hub ids (gpt2) are hub ids: offline, the line names the folder looked for, the hub cache looked
    in, and why the hub was not asked."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    line = one_line(invoke("eval", "--bench", "aime25", "--model", model, "--out", tmp_path / "ev"))
    assert line == (f"error: --model {model}: no folder {tmp_path / model}, and no hub model {model!r} in the local "
                    f"hub cache ({tmp_path / 'hub-cache'}; offline: HF_HUB_OFFLINE=1); check the path, or download "
                    "the model first")


def test_hub_ids_are_one_or_two_names_and_paths_are_not():
    from stare.cli.errors import looks_like_hub_id

    for hub in ("gpt2", "Qwen/Qwen2.5-Math-7B", "HuggingFaceTB/SmolLM2-135M-Instruct", "a.b_c-d"):
        assert looks_like_hub_id(hub), hub
    for path in ("./gpt2", "../m", "/abs/m", "~/m", "a/b/c", "runs/x/final/", "", "a//b", "a/..", ".hidden", "a b"):
        assert not looks_like_hub_id(path), path


def _raw(name: str) -> dict:
    from importlib import resources
    return yaml.safe_load(resources.files("stare.configs").joinpath(f"{name}.yaml").read_text())


def test_a_shipped_preset_on_a_base_is_its_base_but_for_what_its_file_states():
    """The shipped presets written on a ``base:`` (every GPU preset but the paper's recipe): each resolved setting is
    the one the file states, or else its base's resolved value; each algorithm override likewise key by key; the
    backend is the base's. Read against the raw YAML of both files, not through the loader's merge."""
    from stare.cli.presets import load_preset, preset_names

    on_base = {n: _raw(n)["base"] for n in preset_names() if "base" in _raw(n)}
    assert on_base and set(on_base.values()) <= set(preset_names()), on_base
    for name, base in on_base.items():
        raw, got, under = _raw(name), load_preset(name), load_preset(base)
        assert got.name == name and got.backend == under.backend, (name, got.backend)
        for key, value in got.settings.items():
            stated = (raw.get("settings") or {}).get(key, under.settings[key])
            assert value == stated, (name, key, value, stated)
        for algo in set(got.algorithms) | set(under.algorithms):
            want = {**under.algorithms.get(algo, {}), **(raw.get("algorithms") or {}).get(algo, {})}
            assert got.algorithms.get(algo, {}) == want, (name, algo)


def test_a_base_that_leads_back_to_itself_is_refused_with_the_chain(monkeypatch):
    """Shipped presets whose bases form a loop (a -> b -> a) give one PresetError naming the chain, not a
    RecursionError; a base one level down resolves through both."""
    from stare.cli import presets

    files = {"a": "name: a\ndescription: x\nbackend: local\nbase: b\nsettings: {}\n",
             "b": "name: b\ndescription: y\nbackend: local\nbase: a\nsettings: {}\n",
             "c": "name: c\ndescription: z\nbackend: local\nbase: tiny-cpu\nsettings: {steps: 7}\n",
             "d": "name: d\ndescription: w\nbackend: local\nbase: c\nsettings: {seed: 5}\n"}
    real = presets.shipped_preset_text
    monkeypatch.setattr(presets, "preset_names", lambda: [*files, "tiny-cpu"])
    monkeypatch.setattr(presets, "shipped_preset_text", lambda n: files[n] if n in files else real(n))
    with pytest.raises(presets.PresetError, match=r"base 'a' leads back to itself \(a -> b -> a\)"):
        presets.load_preset("a")
    d = presets.load_preset("d")
    tiny = presets.load_preset("tiny-cpu")
    assert (d.name, d.description, d.settings["steps"], d.settings["seed"]) == ("d", "w", 7, 5)
    assert {k: v for k, v in d.settings.items() if k not in ("steps", "seed")} == \
        {k: v for k, v in tiny.settings.items() if k not in ("steps", "seed")}
