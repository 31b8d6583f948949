"""Bad input on the command line: one line on stderr, exit 2, naming the flag and the value; nothing written.

Also the help (flags shown as flags) and rich markup (``[...]`` in user values and hints kept as typed).
"""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from stare.cli import errors
from stare.cli.main import app
from stare.cli.openrlhf_backend import OPENRLHF_VERSION

runner = CliRunner()
COMMANDS = ("presets", "algos", "train", "run", "eval", "compare")


def invoke(*args, **kw):
    return runner.invoke(app, list(args), terminal_width=200, **kw)


def one_line(res) -> str:
    """The single error line of a failed command (exit 2, nothing on stdout, no traceback)."""
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr, res.exception)
    assert res.stdout == "", res.stdout
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr and lines[0].startswith("error: ")
    return lines[0]


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")}


# --- the parser's own errors: every numeric option of every command -------------------------------------

# (command prefix, flag, a value the parser refuses, what the line says about it)
NUMERIC = [
    (["run"], "--seeds", "0", "greater than or equal to 1"),
    (["run"], "--parallel", "0", "greater than or equal to 1"),
    (["run"], "--seeds", "two", "valid integer"),
    (["run"], "--parallel", "1.5", "valid integer"),
    (["run"], "--engines", "0", "greater than or equal to 1"),
    (["run"], "--tp", "0", "greater than or equal to 1"),
    (["run"], "--k", "0", "greater than or equal to 1"),
    (["run"], "--max-tokens", "0", "greater than or equal to 1"),
    (["run"], "--limit", "0", "greater than or equal to 1"),
    (["eval", "--bench", "aime24", "--model", "x/y"], "--limit", "0", "greater than or equal to 1"),
    (["eval", "--bench", "aime24", "--model", "x/y"], "--k", "0", "greater than or equal to 1"),
    (["eval", "--bench", "aime24", "--model", "x/y"], "--k", "-3", "greater than or equal to 1"),
    (["eval", "--bench", "aime24", "--model", "x/y"], "--tp", "0", "greater than or equal to 1"),
    (["eval", "--bench", "aime24", "--model", "x/y"], "--max-tokens", "0", "greater than or equal to 1"),
    (["eval", "--bench", "aime24", "--model", "x/y"], "--limit", "ten", "valid integer"),
    (["eval", "--bench", "aime24", "--model", "x/y"], "--seed", "s", "valid integer"),
    (["eval", "--bench", "aime24", "--model", "x/y"], "--temperature", "hot", "valid number"),
    (["eval", "--bench", "aime24", "--model", "x/y"], "--top-p", "most", "valid number"),
]


@pytest.mark.parametrize("prefix, flag, value, why", NUMERIC)
@pytest.mark.parametrize("form", ["space", "equals"])
def test_numeric_option_errors_are_one_line_naming_flag_and_value(tmp_path, prefix, flag, value, why, form):
    args = [*prefix, flag, value] if form == "space" else [*prefix, f"{flag}={value}"]
    res = invoke(*args, "--out", str(tmp_path / "o"))
    line = one_line(res)
    assert f"{flag} {value}:" in line and why in line, line
    assert not (tmp_path / "o").exists()


def test_every_ranged_option_of_every_command_is_covered():
    """A new ``min=`` option must get a row above: every ranged option is listed there."""
    cmd = typer.main.get_command(app)
    ranged = set()
    for name in COMMANDS:
        for p in cmd.commands[name].params:
            if getattr(p, "min", None) is not None or getattr(p, "max", None) is not None:
                ranged.add((name, max(p.opts, key=len)))
    covered = {(pre[0], flag) for pre, flag, value, why in NUMERIC if "greater" in why}
    assert ranged and ranged <= covered, ranged - covered


@pytest.mark.parametrize("args, expected", [
    (["run", "--bogus"], "no such option: --bogus (see 'stare run --help')"),
    (["trian"], "no such command 'trian'. Did you mean 'train'?"),
    (["train"], "missing option '--preset'"),
    (["compare"], "missing argument"),
    (["run", "--resume=1"], "option '--resume' does not take a value"),
    (["eval", "--bench"], "option '--bench' requires an argument"),
])
def test_other_usage_errors_are_one_line(args, expected):
    assert expected in one_line(invoke(*args))


def test_no_arguments_still_prints_the_help():
    res = invoke()
    assert "Usage: stare" in res.stdout and "presets" in res.stdout and "Traceback" not in res.stderr


def test_the_console_script_path_gives_one_line_too():
    """What a shell runs: ``main()`` in a fresh interpreter (not the test runner's invoke)."""
    res = subprocess.run([sys.executable, "-c", "from stare.cli.main import main; main()", "run", "--seeds", "0"],
                         capture_output=True, text=True, cwd="/")
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == "error: --seeds 0: input should be greater than or equal to 1", res.stderr


# --- help: on/off flags take no value ------------------------------------------------------------------

@pytest.mark.parametrize("command", [[], *[[c] for c in COMMANDS]])
def test_help_shows_flags_without_a_value_type(command):
    res = invoke(*command, "--help")
    assert res.exit_code == 0, res.output
    assert "<bool>" not in res.stdout, res.stdout
    assert "--help" in res.stdout
    if command in (["train"], ["run"], ["eval"]):
        assert "--resume" in res.stdout
    if command and command[0] in ("run", "eval"):  # value-taking options keep their types
        assert "<int" in res.stdout


# --- --out naming a file ---------------------------------------------------------------------------------

@pytest.fixture
def a_file(tmp_path):
    f = tmp_path / "results.txt"
    f.write_text("keep me\n")
    return f


def _out_cases(tmp_path, f):
    model = tmp_path / "model"  # a folder that is not a model: loading it would raise, so the check comes first
    model.mkdir()
    (model / "config.json").write_text("not json")
    run_dir = tmp_path / "somerun"
    run_dir.mkdir()
    return {
        "run": ["run", "--preset", "tiny-cpu", "--set", "steps=1"],
        "train": ["train", "--preset", "tiny-cpu", "--algo", "grpo", "--set", "steps=1"],
        "train-dry-run": ["train", "--preset", "tiny-cpu", "--dry-run"],
        "train-gpu-dry-run": ["train", "--preset", "qwen-7b-short-cot", "--dry-run"],
        "eval": ["eval", "--bench", "aime24", "--model", str(model), "--backend", "hf"],
        "eval-of-a-run": ["eval", "--bench", "aime24"],  # no --model: --out is read as a training run
        "compare": ["compare", str(run_dir)],
    }


@pytest.mark.parametrize("case", ["run", "train", "train-dry-run", "train-gpu-dry-run", "eval", "eval-of-a-run",
                                  "compare"])
@pytest.mark.parametrize("below", [False, True])
def test_out_naming_a_file_is_one_line_and_writes_nothing(tmp_path, a_file, case, below):
    args = _out_cases(tmp_path, a_file)[case]
    out = a_file / "sub" if below else a_file
    before = tree(tmp_path)
    t0 = time.monotonic()
    line = one_line(invoke(*args, "--out", str(out)))
    assert time.monotonic() - t0 < 20
    assert f"--out {out}" in line
    assert ("cannot be made: " + str(a_file) + " is a file") in line if below else "is a file, not a folder" in line
    assert tree(tmp_path) == before  # nothing written, the file untouched


# --- rich markup: [...] in values and hints is text ----------------------------------------------------

def test_set_value_with_brackets_is_named():
    line = one_line(invoke("train", "--preset", "tiny-cpu", "--set", "w=[big]", "--dry-run"))
    assert "--set w=[big]" in line and "got list" in line


def test_model_path_with_brackets_is_named(tmp_path):
    line = one_line(invoke("eval", "--bench", "aime24", "--model", "runs/[tiny]/final", "--out", str(tmp_path / "o")))
    assert "'runs/[tiny]/final'" in line


def test_openrlhf_install_hint_keeps_the_extra(tmp_path, monkeypatch):
    """Without OpenRLHF, the hint is the exact pip command (not ``pip install 'stare'``, what rich's markup would
    leave of it)."""
    import stare.cli.openrlhf_backend as pkg

    monkeypatch.setitem(sys.modules, "stare.cli.openrlhf_backend.plugin", None)  # import fails as when absent
    monkeypatch.delattr(pkg, "plugin", raising=False)
    res = invoke("train", "--preset", "qwen-7b-short-cot", "--out", str(tmp_path / "o"))
    assert res.exit_code == 2, res.output  # a refusal like any other
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    from stare.cli.openrlhf_backend.train import install_hint  # its cases: the test below

    assert len(lines) == 1 and lines[0].endswith(install_hint()) and "[openrlhf]'" in lines[0], res.stderr
    assert "without a GPU only `stare train --dry-run` and `stare run --dry-run` work" in lines[0]
    assert not (tmp_path / "o").exists()


def test_openrlhf_install_hint_fits_where_stare_came_from(tmp_path, monkeypatch):
    from importlib import metadata

    from stare.cli.openrlhf_backend.train import install_hint

    assert install_hint({"STARE_IMAGE": "1"}).startswith("this Docker image should hold it: rebuild it")
    clone = tmp_path / "clone"
    (clone / "stare_cli").mkdir(parents=True)
    (clone / "pyproject.toml").write_text("")
    assert install_hint({}, root=clone).startswith(f"pip install -e '{clone}[openrlhf]', or use the Docker image")

    class Dist:  # an installed stare, from a folder or from an index
        def __init__(self, direct):
            self.direct = direct

        def read_text(self, name):
            return self.direct if name == "direct_url.json" else None

    site = tmp_path / "site-packages"  # no pyproject.toml beside the package: not a clone
    monkeypatch.setattr(metadata, "distributions",
                        lambda name: [Dist('{"url": "file:///src/my%20stare", "dir_info": {}}')])
    assert install_hint({}, root=site).startswith("pip install '/src/my stare[openrlhf]'")
    monkeypatch.setattr(metadata, "distributions", lambda name: [Dist(None)])
    assert install_hint({}, root=site).startswith("pip install 'stare[openrlhf]', or use the Docker image")


def test_fail_prints_markup_characters_as_typed(capsys):
    with pytest.raises(typer.Exit) as info:
        errors.fail("x [bold]y[/] [red] z\\[w]")
    assert info.value.exit_code == 2
    assert capsys.readouterr().err.strip() == "error: x [bold]y[/] [red] z\\[w]"


# --- a hub-id-looking --model that is a mistyped path --------------------------------------------------

def _eval_env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"), **extra)
    return env


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "no-network"])
def test_mistyped_model_path_fails_in_seconds_naming_it(tmp_path, how):
    extra = {"HF_HUB_OFFLINE": "1"} if how == "HF_HUB_OFFLINE" else {"HF_ENDPOINT": "http://127.0.0.1:9"}
    data = tmp_path / "p.jsonl"
    data.write_text('{"problem": "1+1?", "answer": "2"}\n')
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "stare.cli.main", "eval", "--bench", "aime24", "--model",
                          "tiny-cpu/stare", "--data-file", str(data), "--backend", "hf", "--out",
                          str(tmp_path / "o")], capture_output=True, text=True, cwd=tmp_path,
                         env=_eval_env(tmp_path, **extra))
    took = time.monotonic() - t0
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert f"--model tiny-cpu/stare: no folder {tmp_path / 'tiny-cpu' / 'stare'}" in lines[0]
    assert ("HF_HUB_OFFLINE=1" if how == "HF_HUB_OFFLINE" else "cannot be reached") in lines[0]
    assert took < 40, took  # the old code spent ~52 s on retries (imports alone take a few s on a busy CI core)
    assert not (tmp_path / "o").exists()


def test_hub_model_in_the_local_cache_passes_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    snap = tmp_path / "hub" / "models--owner--name" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--owner--name" / "refs").mkdir()
    (tmp_path / "hub" / "models--owner--name" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    errors.check_model_source("owner/name")  # cached: no error
    with pytest.raises(typer.Exit) as info:
        errors.check_model_source("owner/other")
    assert info.value.exit_code == 2


def test_local_folder_model_is_never_looked_up(tmp_path, monkeypatch):
    (tmp_path / "owner" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(errors, "_hub_lookup", lambda *a: pytest.fail("a local folder must not reach the hub"))
    errors.check_model_source("owner/name")


def test_model_not_on_the_hub_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(errors, "_hub_lookup", lambda *a: (False, "no such model on the hub"))
    with pytest.raises(typer.Exit):
        errors.check_model_source("owner/typo")
    assert "--model owner/typo: no folder" in capsys.readouterr().err


# --- words: presets and settings ------------------------------------------------------------------------

def test_tiny_cpu_description_says_what_the_seed_table_shows():
    """README (tiny-cpu, 3 seeds per arm): grpo, dapo and stare collapse; stare-phi holds its entropy up (p 0.05 vs
    dapo) and is less accurate (p 0.05): the description must not claim it is free, nor that STARE's rule holds."""
    from stare.cli.presets import load_preset

    text = load_preset("tiny-cpu").description
    assert "STARE's is held" not in text and "no cost" not in text
    assert "stare collapse" in text and "cost in accuracy" in text and "3 seeds" in text


def test_algos_settings_lists_every_key_with_defaults_and_meaning():
    from stare.algorithms import ALGORITHMS, SETTING_NAMES
    from stare.cli import settings_doc
    from stare.cli.gpu_schema import SCHEMA
    from stare.cli.presets import load_preset, preset_names

    local = [load_preset(n) for n in preset_names() if load_preset(n).backend == "local"]
    local_keys = {k for p in local for k in p.settings}
    assert set(settings_doc.ALGO_SETTING_HELP) == set(SETTING_NAMES)
    assert set(settings_doc.LOCAL_RUN_SETTING_HELP) == local_keys
    assert set(settings_doc.GPU_RUN_SETTING_HELP) == set(SCHEMA)
    res = invoke("algos", "--settings")
    assert res.exit_code == 0, res.output
    rows = {}
    for line in res.stdout.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 3 and cells[0]:
            rows.setdefault(cells[0], cells)
    for key in [*SETTING_NAMES, *local_keys, *SCHEMA]:
        assert key in rows, key
    # defaults read off the registry, not off the printed table: clip_high is 0.28 for dapo, the STARE family and
    # 80-20, 1 for clip-cov, 0.2 else, the common value (the table wraps the exceptions onto further lines)
    assert {n: c.clip_high for n, c in ALGORITHMS.items()} == {"grpo": 0.2, "dr-grpo": 0.2, "dapo": 0.28,
                                                               "stare": 0.28, "stare-c2": 0.28, "stare-phi": 0.28,
                                                               "clip-cov": 1.0, "kl-cov": 0.2, "80-20": 0.28,
                                                               "entropy-adaptive": 0.2, "entropy-adv": 0.2,
                                                               "dg": 0.2, "steer": 0.28}
    assert rows["clip_high"][1] == "0.2 (dapo, stare,"
    assert "stare algorithms" in res.stdout and "steer: 0.28;" in res.stdout and "clip-cov: 1)" in res.stdout
    assert rows["w"][1] == "1.1 (stare-phi: 2)" and rows["std_norm"][1] == "true (dr-grpo: false)"
    steps = {p.name: p.settings["steps"] for p in local}
    assert steps["tiny-cpu"] == 200 and steps["smollm-cpu"] == 30
    assert rows["steps"][1] == "200 (smollm-cpu: 30)" and rows["steps"][2].startswith("RL steps per arm; valid:")
    steps_row = res.stdout[res.stdout.index("│ steps "):].split("│ prompts_per_step")[0]  # its wrapped lines
    assert "integer >= 1" in steps_row, steps_row
    assert rows["model"][1].startswith("tiny (smollm-cpu:")  # wrapped: smollm2-135m on the next line


# --- DeepSpeed's accelerator warning on the CPU path ------------------------------------------------------

def test_cpu_engine_does_not_print_deepspeed_accelerator_warning(tmp_path):
    """Saving a model (what the local engine does for warm starts and checkpoints) makes accelerate import
    DeepSpeed, whose accelerator detection warns on a machine without a GPU; the local engine keeps it quiet."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:  # scripts/test.sh installs it (the openrlhf-cpu extra)
        pytest.skip("deepspeed is not installed: nothing prints the warning")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    save = ("from transformers import LlamaConfig, LlamaForCausalLM; "
            "m = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, "
            f"num_attention_heads=2, num_key_value_heads=2)); m.save_pretrained({str(tmp_path / 'm')!r}); ")
    base = subprocess.run([sys.executable, "-c", save], capture_output=True, text=True, env=env)
    assert base.returncode == 0, base.stderr[-2000:]
    assert "Setting accelerator to CPU" in base.stdout + base.stderr  # the warning (without stare's engine)
    ours = subprocess.run([sys.executable, "-c", "import stare.cli.local.trainer; " + save + "import warnings; "
                           "warnings.warn('other warnings still show')"], capture_output=True, text=True, env=env)
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert "Setting accelerator to CPU" not in ours.stdout + ours.stderr
    assert "other warnings still show" in ours.stderr


# --- progress: live reward, entropy, ETA ------------------------------------------------------------------

def test_last_record_reads_the_last_complete_line(tmp_path):
    from stare.cli.local.progress import last_record, live_status

    f = tmp_path / "metrics.jsonl"
    assert last_record(f) == (0, None)
    f.write_text('{"step": 1, "reward_mean": 0.5, "stare/entropy": 0.9}\n{"step": 2, "reward_mean": 0.625, "stare/entropy": 0.4}\n'
                 '{"step": 3, "rew')  # the writer is mid-line
    n, rec = last_record(f)
    assert n == 2 and rec["step"] == 2
    assert live_status(rec) == "reward 0.62 H 0.40" and live_status(None) == "training"
    assert live_status({"reward_mean": 0.25}) == "reward 0.25"  # telemetry off: no entropy logged


def test_train_progress_shows_live_reward_entropy_and_eta(tmp_path):
    import json

    out = tmp_path / "run[1]"  # brackets: printed as typed, not eaten as markup
    res = invoke("train", "--preset", "tiny-cpu", "--algo", "grpo", "--out", str(out), "--set", "steps=3",
                 "--set", "warmstart_steps=5", "--set", "eval_problems=4", "--set", "prompts_per_step=4",
                 "--set", "samples_per_prompt=4", "--set", "train_problems=50")
    assert res.exit_code == 0, (res.output, res.exception)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    bar = next(line for line in res.stdout.splitlines() if line.startswith("grpo on tiny-cpu"))
    assert "3/3" in bar and f"reward {last['reward_mean']:.2f} H {last['stare/entropy']:.2f}" in bar, bar
    assert " eta " in bar and "Setting accelerator" not in res.output
    # rich folds a long path wherever the line ends, inside the path too (tmp paths are longer under xdist's
    # workers), so the comparison ignores all whitespace; the path itself has none
    flat = "".join(res.stdout.split())
    assert f"rundirectory:{out}" in flat and f"(cachedin{out / 'warmstart'})" in flat, res.stdout


# --- scripts/test.sh: pip's expected resolver report ------------------------------------------------------

def test_pip_filter_replaces_only_the_expected_resolver_report():
    import shutil

    repo = Path(__file__).resolve().parents[1]
    assert "scripts/pip_expected.awk" in (repo / "scripts" / "test.sh").read_text()
    if shutil.which("awk") is None:
        pytest.skip("no awk")
    header = ("ERROR: pip's dependency resolver does not currently take into account all the packages that are "
              "installed. This behaviour is the source of the following dependency conflicts.")
    text = "\n".join([
        "Collecting x",
        header,
        f"openrlhf {OPENRLHF_VERSION} requires flash-attn==2.8.3, which is not installed.",
        f"openrlhf {OPENRLHF_VERSION} requires pynvml>=12.0.0, which is not installed.",
        header,
        f"openrlhf {OPENRLHF_VERSION} requires pynvml, which is not installed.",
        "foo 1.0 requires bar<2, but you have bar 3.0 which is incompatible.",
        "ERROR: Could not find a version that satisfies the requirement nope",
    ]) + "\n"
    res = subprocess.run(["awk", "-f", str(repo / "scripts" / "pip_expected.awk")], input=text,
                         capture_output=True, text=True)
    lines = res.stdout.splitlines()
    assert lines[0] == "Collecting x"
    assert sum("note: pip reports OpenRLHF's flash-attn/pynvml" in x for x in lines) == 1
    assert not any("openrlhf " in x and " requires" in x for x in lines)
    assert lines[-3:] == [header, "foo 1.0 requires bar<2, but you have bar 3.0 which is incompatible.",
                          "ERROR: Could not find a version that satisfies the requirement nope"]
    assert len(lines) == 5


def test_presets_table_prints_descriptions_as_typed(monkeypatch):
    from stare.cli import listing
    from stare.cli.presets import Preset

    monkeypatch.setattr(listing, "preset_names", lambda: ["x"])
    monkeypatch.setattr(listing, "load_preset", lambda name: Preset("x", "needs pip install 'stare[openrlhf]' [red]", "local", {}))
    res = invoke("presets")
    assert res.exit_code == 0 and "pip install 'stare[openrlhf]' [red]" in res.stdout, res.stdout


@pytest.mark.parametrize("raised, expected", [
    ("RepositoryNotFoundError", False),   # the hub says: no such model
    ("GatedRepoError", True),             # exists, gated: loading says what access it needs
    ("HfHubHTTPError", True),             # another hub error (rate limit, outage): loading decides
    ("ConnectError", None),               # no network: the cache decides
])
def test_hub_lookup_classifies_the_hub_answer(monkeypatch, raised, expected):
    import httpx
    import huggingface_hub
    from huggingface_hub import errors as hf_errors

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api/models/o/n"))

    def model_info(*a, **k):
        if raised == "ConnectError":
            raise httpx.ConnectError("Name or service not known")
        raise getattr(hf_errors, raised)("hub said no", response=response)

    monkeypatch.setattr(huggingface_hub, "model_info", model_info)
    assert errors._hub_lookup("o/n", 1.0)[0] is expected


@pytest.mark.parametrize("flag, value", [("--top-p", "0"), ("--top-p", "1.5"), ("--temperature", "2.5")])
def test_protocol_range_errors_name_the_flag(tmp_path, flag, value):
    """Values the parser accepts but the protocol refuses (top_p in (0, 1], temperature in [0, 2]): one line that
    spells the flag as typed, before any model loads."""
    res = invoke("eval", "--bench", "aime24", "--model", "x/y", flag, value, "--out", str(tmp_path / "o"))
    line = one_line(res)
    assert line.startswith(f"error: {flag} must be in ") and f"got {float(value)}" in line, line
    assert not (tmp_path / "o").exists()


# --- a new user's bad input: one line naming it, never a traceback or a silent pass ----------------------------

@pytest.mark.parametrize("case", ["run", "train", "eval", "compare"])
def test_out_that_cannot_be_written_is_one_line_and_writes_nothing(tmp_path, a_file, case, monkeypatch):
    """--out on a read-only file system (Errno 30): one line, no traceback. ``access(2)`` says so even to root, so
    the check is simulated by making ``access`` answer as a read-only file system does."""
    import errno as errno_

    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    monkeypatch.setattr(errors.os, "access", lambda p, mode: False if Path(p) == ro and mode & os.W_OK
                        else real_access(p, mode))
    args = _out_cases(tmp_path, a_file)[case]
    before = tree(tmp_path)
    for out in (ro, ro / "new"):
        line = one_line(invoke(*args, "--out", str(out)))
        assert f"--out {out}" in line and "not writable" in line, line
    assert tree(tmp_path) == before
    assert errno_.EROFS in errors.WRITE_ERRNOS


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o555 folder; the simulated case above covers it")
def test_out_in_a_read_only_folder_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        line = one_line(invoke("train", "--preset", "tiny-cpu", "--out", str(ro / "run"), "--set", "steps=1"))
        assert "not writable" in line
    finally:
        ro.chmod(0o755)


def test_a_write_refused_by_the_file_system_later_is_one_line(tmp_path, monkeypatch):
    """Found only at the write (a file system that turns read-only mid-run): one line naming the file, exit 2."""
    import errno as errno_

    import stare.cli.report.compare as compare_mod

    target = tmp_path / "cmp" / "comparison.md"

    def refuse(dirs, out, baseline=None, warn=None):  # the signature of stare.cli.report.compare.compare
        raise OSError(errno_.EROFS, "Read-only file system", str(target))

    monkeypatch.setattr(compare_mod, "compare", refuse)
    (tmp_path / "r").mkdir()
    line = one_line(invoke("compare", str(tmp_path / "r"), "--out", str(tmp_path / "cmp")))
    assert line == f"error: cannot write {target}: Read-only file system (errno 30); use another --out or free the space"


def test_empty_algos_is_one_line_not_the_default_arms(tmp_path):
    for value in ("", " , "):
        line = one_line(invoke("run", "--algos", value, "--out", str(tmp_path / "o")))
        assert f"--algos {value!r}: no algorithm named" in line and "grpo, dr-grpo" in line, line
    assert not (tmp_path / "o").exists()


def test_missing_absolute_model_path_is_a_missing_folder_not_a_hub_id(tmp_path):
    line = one_line(invoke("eval", "--bench", "aime24", "--model", "/nonexistent", "--out", str(tmp_path / "o")))
    assert "--model '/nonexistent': no such folder (/nonexistent)" in line and "cannot be reached" not in line
    assert not (tmp_path / "o").exists()


def test_model_that_is_a_file_is_one_line(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# stare\n")
    line = one_line(invoke("eval", "--bench", "aime24", "--model", str(readme), "--backend", "hf",
                           "--out", str(tmp_path / "o")))
    assert f"--model {readme} is a file; expected a model folder" in line
    assert not (tmp_path / "o").exists()


def test_data_file_naming_a_folder_is_one_line(tmp_path):
    line = one_line(invoke("eval", "--bench", "aime24", "--model", "x/y", "--data-file", str(tmp_path),
                           "--backend", "hf", "--out", str(tmp_path / "o")))
    assert f"--data-file {tmp_path} is a folder; expected a .jsonl, .json or .parquet file" in line
    assert not (tmp_path / "o").exists()


def test_missing_cold_start_checkpoint_is_refused_by_the_dry_run(tmp_path):
    line = one_line(invoke("train", "--preset", "qwen-7b-tool-use", "--set", "cold_start_checkpoint=/no/such/path",
                           "--dry-run", "--out", str(tmp_path / "o")))
    assert "'cold_start_checkpoint' /no/such/path: no such folder" in line and "hub id" in line
    sft = tmp_path / "sft"
    sft.mkdir()
    res = invoke("train", "--preset", "qwen-7b-tool-use", "--set", f"cold_start_checkpoint={sft}", "--dry-run",
                 "--out", str(tmp_path / "o"))
    assert res.exit_code == 0, res.output


# ---- --set values that change nothing, and a flag given twice (issue 58, item 7) --------------------------------

def test_a_set_no_arm_reads_is_a_warning_line_and_one_some_arm_reads_is_silent():
    res = invoke("train", "--preset", "tiny-cpu", "--algo", "grpo", "--set", "w=1.5", "--dry-run")
    assert res.exit_code == 0
    assert res.stderr.strip() == ("warning: --set w=1.5 changes nothing for grpo: only STARE algorithms use it (stare "
                                  "is off for grpo)")
    res = invoke("run", "--preset", "tiny-cpu", "--algos", "grpo,dapo", "--set", "w=1.5", "--dry-run")
    assert res.exit_code == 0 and "changes nothing for grpo, dapo" in res.stderr
    res = invoke("run", "--preset", "tiny-cpu", "--algos", "grpo,stare", "--set", "w=1.5", "--set", "steps=5",
                 "--dry-run")
    assert res.exit_code == 0 and res.stderr == ""  # stare reads w; steps is every arm's
    res = invoke("train", "--preset", "tiny-cpu", "--algo", "stare", "--set", "band_low=0.1", "--dry-run")
    assert "band_low=0.1 changes nothing for stare: only the band controller uses it" in res.stderr
    res = invoke("train", "--preset", "tiny-cpu", "--algo", "stare-phi", "--set", "band_low=0.1", "--dry-run")
    assert res.exit_code == 0 and res.stderr == ""


@pytest.mark.parametrize("flag, value, item", [("--algos", "dapo", "algos=grpo"), ("--seeds", "2", "seeds=3"),
                                               ("--bench", "aime25", "benches=aime24")])
def test_a_flag_and_a_set_of_its_setting_are_refused_together(flag, value, item):
    preset = "qwen-7b-short-cot" if flag == "--bench" else "tiny-cpu"
    line = one_line(invoke("run", "--preset", preset, flag, value, "--set", item, "--dry-run"))
    assert line == (f"error: {flag} {value} and --set {item} are both given; give one of them ({flag} sets the "
                    f"{item.split('=')[0]} setting)")


@pytest.mark.parametrize("args", [
    ["train", "--preset", "tiny-cpu", "--algo", "ppo", "--dry-run"],
    ["train", "--preset", "qwen-7b-short-cot", "--algo", "ppo", "--dry-run"],
    ["run", "--preset", "tiny-cpu", "--algos", "grpo,ppo", "--dry-run"],
    ["run", "--preset", "tiny-cpu", "--set", "algos=grpo,ppo", "--dry-run"],
    ["run", "--preset", "qwen-7b-short-cot", "--algos", "ppo", "--dry-run"],
])
def test_an_unknown_algorithm_is_said_one_way_everywhere(args, tmp_path):
    """Each way of naming an algorithm ends its one line with the same words: the name and every valid one, in the
    registry's order (written out here from stare algos' table, not from the code's message)."""
    from stare.algorithms import ALGORITHMS

    line = one_line(invoke(*args, "--out", str(tmp_path / "out")))
    assert line.endswith("unknown algorithm 'ppo'; valid algorithms: " + ", ".join(ALGORITHMS)), line
    assert not (tmp_path / "out").exists()
