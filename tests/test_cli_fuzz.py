"""A fuzz test of the CLI: generated bad values for every option and every ``--set`` key of every command.

Wrong types, out of range, empty, unicode, and paths that are files, folders, missing or unwritable, run through the
real entry point in-process (typer's CliRunner, through ``StareGroup.main``: the parser, the checks, the
one-line errors). Every case must exit 2 with one line on stderr, no traceback, and change no file: the scratch
folder (the working directory, where the default outputs would go) is compared before and after each case, and
the repository's presets after all of them. The cases are a fixed, generated list (no randomness).

Nothing slow can start by mistake: training, the arms of ``stare run``, loading a model for ``stare eval`` and the
comparison are replaced by a stand-in that raises ``Accepted``, so a bad value that gets through fails its case at
once instead of training. The count of cases is printed (``-s``) and checked against a floor, so a generator that
stops generating fails too.
"""
from __future__ import annotations

import hashlib
import os
import typing
from dataclasses import fields
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from stare.algorithms import SETTING_NAMES, AlgoConfig
from stare.cli import errors
from stare.cli.local_schema import LOCAL_SETTINGS
from stare.cli.main import app
from stare.cli.gpu_schema import GPU_SETTINGS

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()

UNICODE = "ünï©ødé✓"
# path placeholders, made in the scratch folder by the test
FILE, BELOW_FILE, FOLDER, MISSING, UNWRITABLE = "<FILE>", "<BELOW_FILE>", "<FOLDER>", "<MISSING>", "<UNWRITABLE>"
MODEL, DATA, NOCONFIG, RUN = "<MODEL>", "<DATA>", "<NOCONFIG>", "<RUN>"
PRESETS = "<PRESETS>"  # a folder of bad preset files of one's own (BAD_PRESET_FILES), and one that is not there
BAD_PRESET_FILES = {
    "list.yaml": b"- a list\n", "bad-yaml.yaml": b"a: [\n", "empty.yaml": b"", "not-utf8.yaml": b"base: tiny-cpu\n\xff\n",
    "unknown-field.yaml": b"base: tiny-cpu\nbogus: 1\n", "bad-base.yaml": b"base: nope\n",
    "base-a-path.yaml": b"base: ./list.yaml\n", "bad-value.yaml": b"base: tiny-cpu\nsettings: {steps: 0}\n",
    "bad-type.yaml": b"base: tiny-cpu\nsettings: {steps: many}\n", "settings-list.yaml": b"base: tiny-cpu\nsettings: [1]\n",
    "other-backend.yaml": b"base: tiny-cpu\nbackend: openrlhf\n", "bad-name.yaml": b"base: tiny-cpu\nname: 'a/b'\n",
    "bad-algo.yaml": b"base: tiny-cpu\nalgorithms: {nope: {}}\n", "bad-algo-value.yaml": b"base: tiny-cpu\nalgorithms: "
    b"{grpo: {clip_high: -1}}\n", "gpu-bad.yaml": b"base: qwen-7b-short-cot\nsettings: {zero_stage: 4}\n",
    "no-description.yaml": b"name: x\nbackend: local\nsettings: {}\n",
}
PRESET_FILE_VALUES = [f"{PRESETS}/{name}" for name in BAD_PRESET_FILES] + [f"{PRESETS}/missing.yaml", PRESETS]

TRAIN = ["train", "--preset", "tiny-cpu", "--algo", "grpo"]
TRAIN_GPU = ["train", "--preset", "qwen-7b-short-cot", "--algo", "stare", "--dry-run"]
RUN_CMD = ["run", "--preset", "tiny-cpu"]
RUN_GPU = ["run", "--preset", "qwen-7b-short-cot", "--dry-run"]
EVAL = ["eval", "--bench", "aime24", "--model", MODEL, "--backend", "hf", "--data-file", DATA]
COMPARE = ["compare", RUN]


def _replace(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced (or the flag added)."""
    if flag in args:
        i = args.index(flag)
        return [*args[:i], flag, value, *args[i + 2:]]
    return [*args, flag, value]


def bad_values_for_type(typ, *, low=None, high=None, nullable=False, choices=None) -> list[str]:
    """Generated bad texts for a value of type ``typ`` (int, float, bool, str)."""
    if typ is bool:
        return ["maybe", "2", "", UNICODE, "[true]"]
    if typ is int:
        out = ["x", "1.5", "true", UNICODE, "[1]"] + ([] if nullable else [""])
        if low is not None:
            out.append(str(int(low) - 1))
        if high is not None:
            out.append(str(int(high) + 1))
        return out
    if typ is float:
        out = ["x", "true", UNICODE, "{a: 1}"] + ([] if nullable else [""])
        if low is not None:
            out.append(str(low - 1) if isinstance(low, int) else str(float(low) - 1.0))
        if high is not None:
            out.append(str(float(high) + 1.0))
        return out
    if choices is not None:
        return ["nope", "", UNICODE, "123"]
    return []


def set_cases() -> list[tuple[str, list[str], str | None]]:
    cases = []
    # local presets: every setting of the schema, on train (dry run and not), the first few on run too
    for s in LOCAL_SETTINGS:
        vals = bad_values_for_type(s.type, low=s.low if not s.low_open else s.low - (1 if s.type is int else 0.5),
                                   high=s.high, choices=s.choices)
        if s.name == "algos":
            vals = ["nope", "", UNICODE, "grpo,grpo", ",", "grpo,nope"]
        if s.low is not None and s.low_open:
            vals.append(str(s.low))  # the open bound itself
        for v in vals:
            item = f"{s.name}={v}"
            cases.append((f"train --set {item} --dry-run", [*TRAIN, "--dry-run", "--set", item], s.name))
            cases.append((f"train --set {item}", [*TRAIN, "--set", item], s.name))
            cases.append((f"run --set {item}", [*RUN_CMD, "--set", item], s.name))
    # algorithm settings: every AlgoConfig field --set accepts
    hints = typing.get_type_hints(AlgoConfig)
    for key in SETTING_NAMES:
        hint = hints[key]
        nullable = "None" in str(hint)
        base = next(t for t in (bool, int, float, str) if t is hint or t in typing.get_args(hint))
        vals = bad_values_for_type(base, nullable=nullable, choices=() if base is str else None)
        for v in vals:
            item = f"{key}={v}"
            cases.append((f"train --algo stare --set {item} --dry-run", [*TRAIN[:3], "--algo", "stare", "--dry-run",
                                                                          "--set", item], key))
    # GPU presets: every setting of the OpenRLHF schema (gpu_schema.py)
    # GPU presets: every setting of the OpenRLHF schema (gpu_schema.py), its bounds as the local loop's
    for s in GPU_SETTINGS:
        if s.type is str and s.choices is None:
            continue  # free text (ids, paths, templates): the value-specific cases are below
        low = None if s.low is None else (s.low if not s.low_open else s.low - (1 if s.type is int else 0.5))
        vals = bad_values_for_type(s.type, low=low, high=s.high, choices=s.choices)
        vals = [v for v in vals if s.choices is None or v not in map(str, s.choices)]  # agent '' is single turn
        if s.low is not None and s.low_open:
            vals.append(str(s.low))  # the open bound itself
        for v in vals:
            cases.append((f"train gpu --set {s.name}={v}", [*TRAIN_GPU, "--set", f"{s.name}={v}"], s.name))
    # the values a new user tried (issue 58): each passed the dry run with its flag in the argv
    for item in ["agent=nope", "prompt_template=no placeholder", "cold_start_checkpoint=/no/such/path",
                 "zero_stage=4", "vllm_gpu_memory_utilization=1.5", "samples_per_prompt=1", "lr=-1",
                 "warmup_ratio=5", "temperature=-1", "save_steps=0", "seed=-7"]:
        cases.append((f"train gpu --set {item}", [*TRAIN_GPU, "--set", item], item.split("=")[0]))
    # the shape of --set itself
    for item in ["nope=1", "=1", "noequals", "", f"{UNICODE}=1", " steps=0"]:
        named = item.split("=")[0].strip() or None
        cases.append((f"train --set {item!r}", [*TRAIN, "--dry-run", "--set", item], named))
        cases.append((f"run --set {item!r}", [*RUN_CMD, "--set", item], named))
    return cases


def option_cases() -> list[tuple[str, list[str], str | None]]:
    out_paths = [FILE, BELOW_FILE, UNWRITABLE, f"{UNWRITABLE}/new"]
    table = {  # command base -> {flag: bad values}
        "train": (TRAIN, {"--preset": ["nope", "", UNICODE, *PRESET_FILE_VALUES], "--algo": ["nope", "", UNICODE, "GRPO"],
                          "--out": out_paths, "--ray-address": ["host:1"]}),
        "train-dry": ([*TRAIN, "--dry-run"], {"--preset": ["nope", "", *PRESET_FILE_VALUES], "--algo": ["nope", ""],
                                              "--out": out_paths, "--ray-address": ["host:1"]}),
        "train-gpu": (TRAIN_GPU, {"--ray-address": ["bad", "", UNICODE, "host:port", "host:0x"],
                                  "--out": out_paths}),
        "run": (RUN_CMD, {"--preset": ["nope", "", UNICODE, *PRESET_FILE_VALUES],
                          "--algos": ["", "nope", "grpo,grpo", ",", UNICODE],
                          "--seeds": ["0", "-1", "x", "", "1.5", UNICODE], "--parallel": ["0", "-2", "x", ""],
                          "--sweep": ["", "w", "w=", "w=1,1", "w=abc", UNICODE], "--out": out_paths}),
        "run-gpu": (RUN_GPU, {"--bench": ["nope", "", ",", UNICODE, "aime24,aime24", "AIME24"],
                              "--ray-address": ["bad", "", UNICODE, "host:port"], "--parallel": ["0", "2", "x"],
                              "--k": ["0", "x"], "--limit": ["0"], "--backend": ["nope", UNICODE],
                              "--algos": ["", "nope", "grpo,grpo"], "--out": out_paths,
                              "--engines": ["0", "x"], "--tp": ["0", "x"], "--batching": ["nope", "", UNICODE]}),
        "eval": (EVAL, {"--bench": ["nope", "", UNICODE, "AIME24"],
                        "--model": [MISSING, FILE, NOCONFIG, "", UNICODE, "/nonexistent", "./no/such"],
                        "--k": ["0", "-1", "x", "", "1.5"], "--protocol": ["nope", "", UNICODE],
                        "--temperature": ["-0.1", "2.5", "nan", "inf", "x", ""],
                        "--top-p": ["0", "1.5", "nan", "-1", "x", ""], "--max-tokens": ["0", "-5", "x", ""],
                        "--backend": ["nope", "", UNICODE], "--harness": ["nope", "", UNICODE],
                        "--tp": ["0", "x"], "--data-file": [FOLDER, MISSING, FILE, ""],
                        "--limit": ["0", "-1", "x"], "--seed": ["x", "1.5", ""], "--out": out_paths,
                        "--tools": ["nope", "", UNICODE], "--engines": ["0", "-1", "x", "", "1.5", "autox", "AUTO"],
                        "--batching": ["nope", "", UNICODE, "ALL"],
                        "--ray-address": [""], "--checkpoints": ["nope", "", "every:0", "every:x", "every:-2", UNICODE]}),
        "compare": (COMPARE, {"--out": out_paths, "--baseline": ["nope", "", UNICODE, "DAPO"]}),
        "presets": (["presets"], {"--show": ["nope", "", UNICODE, "tiny-cpu.yaml", PRESETS]}),
    }
    cases = []
    for name, (base, flags) in table.items():
        for flag, values in flags.items():
            for v in values:
                cases.append((f"{name} {flag} {v!r}", _replace(base, flag, v), v or None))
        cases.append((f"{name} --bogus", [*base, "--bogus"], "--bogus"))
    # value combinations that are bad together
    cases += [
        ("eval greedy with k 2", [*EVAL, "--temperature", "0", "--k", "2"], "--k"),
        ("eval no --model, --out not a run", ["eval", "--bench", "aime24", "--out", FOLDER], "--model"),
        ("eval --resume with lm-eval", [*EVAL, "--harness", "lm-eval", "--resume"], "--resume"),
        ("eval --engines 2 with lm-eval", [*EVAL, "--harness", "lm-eval", "--engines", "2"], "--engines 2"),
        ("eval --engines auto with lm-eval", [*EVAL, "--harness", "lm-eval", "--engines", "auto"], "--engines auto"),
        ("eval --batching invariant with hf", [*EVAL, "--batching", "invariant"], "--batching invariant"),
        ("eval --batching problem with lm-eval", [*EVAL, "--harness", "lm-eval", "--batching", "problem"],
         "--batching problem"),
        ("run --batching on a local preset", [*RUN_CMD, "--batching", "problem"], "--batching"),
        ("run --batching invariant with hf", [*RUN_GPU, "--backend", "hf", "--batching", "invariant"],
         "--batching invariant"),
        ("train --resume with nothing to resume", [*TRAIN, "--out", FOLDER, "--resume"], FOLDER),
        ("run --sweep an unknown key", [*RUN_CMD, "--sweep", "nope=1,2"], "nope"),
        ("run --sweep w over grpo, which does not use it", [*RUN_CMD, "--algos", "grpo", "--sweep", "w=1,2"], "grpo"),
        ("run --sweep a value the schema refuses", [*RUN_CMD, "--algos", "stare", "--sweep", "w=2,-1"], "w=-1"),
        ("run --sweep one key twice", [*RUN_CMD, "--algos", "stare", "--sweep", "w=1,2", "--sweep", "w=4"], "twice"),
        ("compare a missing folder", ["compare", MISSING], MISSING),
        ("compare a unicode name", ["compare", UNICODE], UNICODE),
    ]
    return cases


CASES = option_cases() + set_cases()
MIN_CASES = 600  # the generators above make more; fewer means one stopped generating


class Accepted(Exception):
    """A bad value got past every check (the stand-in for the slow part ran)."""


def _accept(*args, **kwargs):
    raise Accepted


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")}


def presets_digest() -> str:
    h = hashlib.sha256()
    for p in sorted((ROOT / "configs").glob("*.yaml")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    from stare.cli.local import runner as runner_mod, trainer as trainer_mod
    from stare.eval import backends

    monkeypatch.setattr(trainer_mod.LocalTrainer, "run", _accept)
    monkeypatch.setattr(runner_mod, "run_arms", _accept)
    monkeypatch.setattr(backends, "make_backend", _accept)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub-looking --model is judged without the network
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("STARE_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file.txt").write_text("keep me\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "ro").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "data.jsonl").write_text('{"id": "p1", "problem": "What is 1+1?", "answer": "2"}\n')
    (tmp_path / "arun").mkdir()  # a training run as `stare compare` reads one: config.yaml + metrics.jsonl
    (tmp_path / "arun" / "config.yaml").write_text("preset: tiny-cpu\nbackend: local\nalgo: {name: dapo}\n"
                                                   "settings: {model: tiny, task: reverse}\n")
    (tmp_path / "arun" / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5, "stare/entropy": 0.4}\n')
    (tmp_path / "presets").mkdir()
    for name, data in BAD_PRESET_FILES.items():
        (tmp_path / "presets" / name).write_bytes(data)
    ro = tmp_path / "ro"
    real_access = os.access
    # an unwritable folder: access(2) answers as on a read-only file system (root ignores permissions)
    monkeypatch.setattr(errors.os, "access", lambda p, mode: False if Path(p) == ro and mode & os.W_OK
                        else real_access(p, mode))
    paths = {FILE: tmp_path / "a-file.txt", BELOW_FILE: tmp_path / "a-file.txt" / "sub", FOLDER: tmp_path / "folder",
             MISSING: tmp_path / "no" / "such", UNWRITABLE: ro, MODEL: tmp_path / "model", DATA: tmp_path / "data.jsonl",
             NOCONFIG: tmp_path / "noconfig", RUN: tmp_path / "arun", PRESETS: tmp_path / "presets"}
    return tmp_path, paths


def _fill(args: list[str], paths: dict) -> list[str]:
    out = []
    for a in args:
        for key, value in paths.items():
            a = a.replace(key, str(value))
        out.append(a)
    return out


def check_case(args: list[str], root: Path, named: str | None = None) -> str | None:
    """Why one case failed (None: one line, exit 2, no traceback, nothing written, and the line names ``named``,
    the bad value or key, when given)."""
    before = tree(root)
    res = runner.invoke(app, args, terminal_width=200)
    if isinstance(res.exception, Accepted):
        return "accepted: the slow part started"
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    if res.exit_code != 2:
        return f"exit {res.exit_code} ({type(res.exception).__name__}: {res.exception}) {res.stderr[-300:]!r}"
    if len(lines) != 1 or not lines[0].startswith("error: ") or "Traceback" in res.stderr:
        return f"not one error line: {res.stderr[-500:]!r}"
    if res.stdout:
        return f"printed on stdout: {res.stdout[:200]!r}"
    if named and named not in lines[0]:
        return f"the line does not name {named!r}: {lines[0]!r}"
    if tree(root) != before:
        return "changed files in the scratch folder"
    return None


def test_every_generated_bad_input_is_one_line_exit_2_and_writes_nothing(scratch, capsys):
    root, paths = scratch
    presets = presets_digest()
    failures = []
    for name, args, named in CASES:
        why = check_case(_fill(args, paths), root, named=named and _fill([named], paths)[0])
        if why:
            failures.append(f"{name}: {why}")
    with capsys.disabled():
        print(f"\nCLI fuzz: {len(CASES)} bad inputs tried, {len(failures)} failed")
    assert presets_digest() == presets  # nothing outside the scratch folder changed
    assert not failures, "\n".join(failures[:40]) + f"\n({len(failures)} of {len(CASES)})"
    assert len(CASES) >= MIN_CASES, len(CASES)


def test_every_option_of_every_command_has_bad_values():
    """A new option must get bad values above: every option of every command is named by a case."""
    cmd = typer.main.get_command(app)
    given = {a for _, args, _ in CASES for a in args if a.startswith("--")}
    missing = []
    for name, sub in cmd.commands.items():
        for p in sub.params:
            if getattr(p, "param_type_name", "") != "option" or getattr(p, "is_flag", False):
                continue
            if not set(p.opts) & given:
                missing.append(f"{name} {max(p.opts, key=len)}")
    assert not missing, missing


def test_the_harness_catches_each_kind_of_failure(scratch, monkeypatch):
    """The per-case check can fail: a traceback, exit 0, a second line and a written file are each reported."""
    root, paths = scratch
    import stare.cli.main as main_mod

    good = [*TRAIN, "--dry-run"]
    assert check_case(_fill(good, paths), root).startswith("exit 0")
    monkeypatch.setattr(main_mod, "resolve", lambda *a: (_ for _ in ()).throw(KeyError("planted")))
    assert "KeyError" in check_case(_fill(good, paths), root)
    monkeypatch.undo()
    assert check_case(_fill([*TRAIN, "--set", "steps=0"], paths), root) is None


def test_fields_of_the_registry_are_all_fuzzed():
    keys = {args[-1].split("=")[0] for _, args, _ in CASES if "--set" in args}
    assert set(SETTING_NAMES) <= keys and {s.name for s in LOCAL_SETTINGS} <= keys
    assert {s.name for s in GPU_SETTINGS if s.type is not str} <= keys
    assert len(fields(AlgoConfig)) >= len(SETTING_NAMES)
