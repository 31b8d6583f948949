"""`stare train` on GPU presets from the command line: the dry run's one JSON object, and bad input (one line,
exit code 2, nothing started and nothing written)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from stare.cli.openrlhf_backend import OPENRLHF_VERSION
from stare.cli.presets import PresetError, parse_preset


def stare(*args, cwd):
    return subprocess.run([sys.executable, "-c", "from stare.cli.main import main; main()", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def test_dry_run_prints_one_json_object(tmp_path):
    res = stare("train", "--preset", "qwen-7b-long-cot", "--algo", "stare-c2", "--set", "w=1.2",
                "--out", "runs/a", "--dry-run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)  # the whole of stdout is one JSON object
    assert {"openrlhf_argv", "command", "stare", "ray"} <= set(plan)
    assert plan["stare"]["w"] == 1.2 and plan["stare"]["variant"] == "C2"
    assert plan["ray"]["start_local_head"] is True
    assert str(tmp_path / "runs" / "a" / "ckpt") in plan["openrlhf_argv"]
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


CLOSED_PORT = "{closed port}"  # in an argument: a port bound (so no other process can take it) and not listening


@pytest.fixture
def closed_port():
    """A local port that refuses connections for the whole test: bound here, never listening. (A port closed
    before the test ran could be taken meanwhile by another process's listener, Ray's in a parallel test.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (["--preset", "qwen-9b"], "unknown preset 'qwen-9b'; valid presets: "),
    (["--preset", "qwen-7b-short-cot", "--algo", "ppo"], "unknown algorithm 'ppo'; valid algorithms: grpo, "),
    (["--preset", "qwen-7b-short-cot", "--set", "gpus=8"], "unknown --set key 'gpus'; valid keys: "),
    (["--preset", "qwen-7b-short-cot", "--set", "nodes=two"], "--set nodes=two: expected integer >= 1, got str 'two'"),
    (["--preset", "qwen-7b-short-cot", "--set", "vllm_engines=3"], "vllm_engines x vllm_tensor_parallel (3 x 1)"),
    (["--preset", "qwen-7b-tool-use"], "pass --set cold_start_checkpoint=PATH"),
    (["--preset", "qwen-7b-short-cot", "--ray-address", "head-without-port"], "is not HOST:PORT"),
    (["--preset", "qwen-7b-short-cot", "--ray-address", f"127.0.0.1:{CLOSED_PORT}"],
     "cannot reach the Ray cluster at '127.0.0.1:"),
    (["--preset", "tiny-cpu", "--ray-address", "127.0.0.1:6379"], "--ray-address 127.0.0.1:6379: the flag is for GPU presets"),
])
def test_bad_input_is_one_line_exit_2_and_starts_nothing(tmp_path, closed_port, args, message):
    args = [a.replace(CLOSED_PORT, str(closed_port)) for a in args]
    res = stare("train", *args, "--out", "run", cwd=tmp_path)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], res.stderr
    assert not (tmp_path / "run").exists()


GPU = """name: x
description: d
backend: openrlhf
settings:
  model: m
  data: d/e
  prompt_template: "{problem} boxed"
  samples_per_prompt: 8
  prompts_per_step: 4
  train_batch_size: 32
  max_prompt_len: 10
  max_response_len: 20
  lr: 1.0e-6
  gpus_per_node: 1
  nodes: 1
  vllm_engines: 1
  vllm_tensor_parallel: 1
"""


def test_a_good_gpu_preset_file_fills_defaults():
    p = parse_preset(GPU, source="x.yaml", expected_name="x")
    assert p.settings["zero_stage"] == 3 and p.settings["lr"] == 1e-6 and p.settings["agent"] == ""


@pytest.mark.parametrize("edit, pattern", [
    (("  lr: 1.0e-6\n", ""), "missing the setting 'lr'"),
    (("samples_per_prompt: 8", "samples_per_prompt: eight"), "setting samples_per_prompt: expected integer >= 2, got str 'eight'"),
    (("samples_per_prompt: 8", "samples_per_prompt: true"), "setting samples_per_prompt: expected integer >= 2, got bool True"),
    (("lr: 1.0e-6", "lr: fast"), "setting lr: expected number > 0, got str 'fast'"),
    (("model: m", "model: m\n  gpu: 8"), "unknown setting 'gpu'"),
    (('"{problem} boxed"', '"no placeholder"'), "prompt_template must contain {problem}"),
    (("train_batch_size: 32", "train_batch_size: 5"), "must be a multiple of train_batch_size"),
    (("nodes: 1", "nodes: 0"), "setting nodes: expected integer >= 1, got 0"),
])
def test_gpu_preset_file_validation(edit, pattern):
    with pytest.raises(PresetError, match=pattern):
        parse_preset(GPU.replace(*edit), source="x.yaml", expected_name="x")


def test_another_openrlhf_version_is_refused_before_anything_is_written(tmp_path):
    code = ("import importlib.metadata as md\n"
            "real = md.version\n"
            "md.version = lambda n: '0.0.1' if n == 'openrlhf' else real(n)\n"
            "from stare.cli.main import main; main()\n")
    res = subprocess.run([sys.executable, "-c", code, "train", "--preset", "qwen-7b-short-cot", "--out", "run"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert res.returncode == 2, res.stderr
    assert f"written against openrlhf=={OPENRLHF_VERSION}, found 0.0.1" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists()


def test_telemetry_setting_travels_to_the_plugin_and_bad_values_exit_2(tmp_path):
    res = stare("train", "--preset", "qwen-7b-short-cot", "--algo", "grpo", "--set", "telemetry=off",
                "--out", "runs/a", "--dry-run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    env = json.loads(plan["ray"]["runtime_env"]["env_vars"]["STARE_SETTINGS"])
    assert env["algo"]["telemetry"] == "off" and plan["stare"] == {}
    res = stare("train", "--preset", "qwen-7b-short-cot", "--algo", "stare", "--set", "telemetry=entropy",
                "--out", "runs/a", "--dry-run", cwd=tmp_path)
    assert json.loads(res.stdout)["stare"]["telemetry"] == "entropy"
    res = stare("train", "--preset", "qwen-7b-short-cot", "--algo", "stare", "--set", "telemetry=some",
                "--out", "runs/a", "--dry-run", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = (res.stderr + res.stdout).strip().splitlines()
    assert len(lines) == 1 and "telemetry 'some'" in lines[0] and "full, entropy, off" in lines[0], lines
