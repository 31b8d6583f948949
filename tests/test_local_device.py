"""The local engine's ``device`` setting: validation before anything is written, ``cpu`` exactly the default,
no tensor left on torch's default device, and checkpoints that load on a machine without the saving device.

No GPU here: what only a GPU can show (the engine training on CUDA end to end, several arms sharing one GPU) is
the ``stare-run-tiny-cpu`` step of ``scripts/gpu-check.sh``.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stare.cli.local import trainer as trainer_mod
from stare.cli.presets import PresetError, parse_preset, resolve
from stare.cli.rundir import RunDirError, check_run_dir, prepare_run_dir

FAST = ["warmstart_steps=100", "warmstart_noise=0.3", "eval_problems=4", "eval_k=2", "prompts_per_step=4",
        "samples_per_prompt=4", "train_problems=200", "micro_batch_size=8",
        "seeds=1"]
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no GPU")


def stare(*args):
    return subprocess.run([sys.executable, "-m", "stare.cli.main", *args], capture_output=True, text=True)


def one_line(res) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


@pytest.mark.parametrize("command", [["train", "--algo", "grpo"], ["run", "--algos", "grpo"]])
@pytest.mark.parametrize("value", ["gpu", pytest.param("cuda", marks=NO_GPU)])
def test_a_bad_or_absent_device_fails_in_one_line_before_anything_is_written(tmp_path, command, value):
    out = tmp_path / "x"
    line = one_line(stare(*command, "--preset", "tiny-cpu", "--set", f"device={value}", "--out", str(out)))
    assert "device" in line and f"'{value}'" in line and "auto, cpu, cuda" in line
    if value == "cuda":
        assert "no GPU" in line
    assert not out.exists()


def test_a_preset_with_a_bad_device_is_refused():
    text = ("name: t\ndescription: d\nbackend: local\nsettings: {task: reverse, device: tpu}\n")
    with pytest.raises(PresetError, match=r"setting device: unknown value 'tpu'; valid choices: auto, cpu, cuda"):
        parse_preset(text, source="t.yaml")


def _train(tmp_path, name, sets, steps=3):
    res = resolve("tiny-cpu", "stare-phi", FAST + [f"steps={steps}"] + sets)
    out = tmp_path / name
    prepare_run_dir(out, res, False)
    result = trainer_mod.LocalTrainer(res, out).run()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "time_s"} for r in rows], result


def test_device_cpu_is_exactly_the_default(tmp_path):
    assert resolve("tiny-cpu", "grpo")["settings"]["device"] == "cpu"
    default, default_eval = _train(tmp_path, "default", [])
    cpu, cpu_eval = _train(tmp_path, "cpu", ["device=cpu"])
    assert len(default) == 3 and not any(r.get("skipped") for r in default)
    assert cpu == default and cpu_eval == default_eval


def test_no_tensor_of_a_step_or_of_the_evaluation_is_left_on_the_default_device(tmp_path):
    """Under ``torch.device("meta")`` every tensor made without an explicit device is a meta tensor (no data): the
    first time one meets the policy's tensors or is read, the step fails. With the policy on CPU (its device named
    explicitly), a step and the evaluation only pass when the engine builds every tensor on the policy's device
    (the same code path a GPU run takes: the prompts, rewards, shuffles, padding, masks, generators)."""
    from stare.cli.local.evaluate import evaluate_policy

    res = resolve("tiny-cpu", "stare-phi", FAST + ["steps=2"])
    out = tmp_path / "run"
    prepare_run_dir(out, res, False)
    tr = trainer_mod.LocalTrainer(res, out)
    tr._build(tr._initial_policy_dir())
    tr.train_step()  # the optimizer's lazily created state, outside the check (AdamW's own step counter)
    with torch.device("meta"):
        rec = tr.train_step()
        result = evaluate_policy(tr.model, tr.tokenizer, tr.task, n_problems=4, k=2, seed=0, max_new_tokens=9)
    assert not rec.get("skipped") and rec["batch_prompts"] > 0 and result["n_problems"] == 4


def test_a_checkpoint_saved_on_a_gpu_resumes_on_a_cpu(tmp_path, monkeypatch):
    """A checkpoint whose tensors are tagged ``cuda:0`` (as a GPU run writes them) and whose sampling generator is
    a CUDA one (16 bytes of Philox state) resumes here: read with map_location, the generator seeded again."""
    res = resolve("tiny-cpu", "stare-phi", FAST + ["steps=3", "save_every=1"])
    out = tmp_path / "run"
    prepare_run_dir(out, res, False)

    class Stop(Exception):
        pass

    def stop_after_two(step, steps, rec):
        if step == 2:
            raise Stop

    with pytest.raises(Stop):
        trainer_mod.LocalTrainer(res, out).run(on_step=stop_after_two)
    state_file = out / "checkpoint" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=False)
    state.update(device="cuda", generator=torch.zeros(16, dtype=torch.uint8))
    monkeypatch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
    torch.save(state, state_file)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="CUDA"):  # what a plain torch.load does with it on this machine
        torch.load(state_file, weights_only=False)
    result = trainer_mod.LocalTrainer(res, out).run(resume=True)
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 2, 3] and result["steps"] == 3


def test_a_run_resumes_on_another_device_but_not_with_other_settings(tmp_path):
    res = resolve("tiny-cpu", "grpo")
    out = tmp_path / "run"
    out.mkdir()
    old = json.loads(json.dumps(res))
    # started on a GPU, or a folder from before the setting (no device at all); likewise another statistics
    # kernel (they differ in rounding only), or a folder from before that setting
    for section, key, value in (("settings", "device", "cuda"), ("settings", "device", None),
                                ("algo", "stats_kernel", "compiled"), ("algo", "stats_kernel", None)):
        if value is None:
            del old[section][key]
        else:
            old[section][key] = value
        (out / "config.yaml").write_text(json.dumps(old))
        assert check_run_dir(out, res, resume=True) is True, (section, key, value)
    old["algo"]["w"] = 1.3  # an algorithm setting is another run
    (out / "config.yaml").write_text(json.dumps(old))
    with pytest.raises(RunDirError, match="other settings"):
        check_run_dir(out, res, resume=True)
    old["algo"]["w"] = res["algo"]["w"]
    old["settings"]["lr"] = 0.5
    (out / "config.yaml").write_text(json.dumps(old))
    with pytest.raises(RunDirError, match="other settings"):
        check_run_dir(out, res, resume=True)


def test_a_gpu_warm_start_never_shares_the_cpu_cache():
    assert trainer_mod.warmstart_name(torch.device("cpu")) == "warmstart"  # the old folder, unchanged
    assert trainer_mod.warmstart_name(torch.device("cuda"), "seed0") == "seed0-cuda"


def test_auto_is_the_gpu_when_torch_sees_one_and_the_cpu_otherwise(monkeypatch):
    from stare.cli.local.device import DeviceError, engine_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_device({"device": "auto"}) == torch.device("cpu")
    assert engine_device({}) == torch.device("cpu")  # a config.yaml from before the setting
    with pytest.raises(DeviceError, match="no GPU"):
        engine_device({"device": "cuda"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_device({"device": "auto"}) == torch.device("cuda")
    assert engine_device({"device": "cpu"}) == torch.device("cpu")
