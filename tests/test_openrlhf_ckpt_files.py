"""The controller's state files beside OpenRLHF's checkpoints (``ckpt/stare/<tag>.json``), in seconds: saved under
exactly the tag OpenRLHF's policy actor saves, kept for exactly the checkpoints OpenRLHF keeps (its own rotation,
``max_num`` and metric-aware), and restored only when OpenRLHF loads a checkpoint, from the tag DeepSpeed loads.

What runs for real: our ``StarePolicyModelActor.save_checkpoint`` and ``init_model_from_pretrained``, the pinned
OpenRLHF's ``PolicyModelActor.save_checkpoint`` and ``DeepspeedStrategy.save_ckpt`` (the rotation). Stood in: the
DeepSpeed engine's own ``save_checkpoint`` (a tag folder and DeepSpeed's ``latest`` file, as it writes them), the
model loading behind ``init_model_from_pretrained``, and the controller (a counter). The same files through the
real loop: tests/test_openrlhf_e2e.py (``test_controller_state_files_follow_openrlhfs_checkpoints``).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace as ns

import pytest

pytest.importorskip("openrlhf")
deepspeed = pytest.importorskip("deepspeed")
import openrlhf_standins  # noqa: E402

openrlhf_standins.install()
from openrlhf.trainer.ray import ppo_actor  # noqa: E402
from openrlhf.utils.deepspeed import deepspeed as ds_strategy  # noqa: E402
from openrlhf.utils.deepspeed.deepspeed import DeepspeedStrategy  # noqa: E402

from stare.cli.openrlhf_backend import actor as stare_actor  # noqa: E402


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    """One rank, no process group: OpenRLHF's barriers between ranks have nobody to wait for."""
    for module in (ppo_actor, ds_strategy):
        monkeypatch.setattr(module, "torch_dist_barrier_and_cuda_sync", lambda: None)


class Engine(deepspeed.DeepSpeedEngine):
    """DeepSpeed's engine as far as a save goes: the tag's folder, then ``latest`` naming it."""

    def __init__(self):  # no model, no optimizer
        pass

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True):
        Path(save_dir, tag).mkdir(parents=True, exist_ok=True)
        Path(save_dir, tag, "mp_rank_00_model_states.pt").write_bytes(b"x")
        if save_latest:
            Path(save_dir, "latest").write_text(tag)


class Stare:
    """The controller's state: which step it has seen."""

    def __init__(self, step=0):
        self.step = step

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def policy_actor(ckpt: Path, *, max_num=2, load_enable=False):
    """Our policy actor without Ray or a model: OpenRLHF's strategy (its real save_ckpt) and the settings it reads."""
    args = ns(ckpt=ns(path=str(ckpt), max_num=max_num, max_mem=1000, load_enable=load_enable),
              train=ns(enable_ema=False))
    strategy = DeepspeedStrategy.__new__(DeepspeedStrategy)
    strategy.args = args
    a = stare_actor.StarePolicyModelActor.__new__(stare_actor.StarePolicyModelActor)
    a.strategy, a.actor, a.disable_ds_ckpt, a.save_hf_ckpt = strategy, ns(model=Engine()), False, False
    a.trainer = ns(stare=Stare())
    return a


def saves(a, steps_and_metrics):
    for step, metric in steps_and_metrics:
        a.trainer.stare.step = step
        a.save_checkpoint(f"global_step{step}", {"global_step": step}, metric_value=metric,
                          metric_key=None if metric is None else "eval_pass1")


def tags(folder: Path, suffix=""):
    return sorted(p.name.removesuffix(suffix) for p in folder.iterdir() if (p.is_dir() if not suffix
                                                                         else p.name.endswith(suffix)))


@pytest.mark.parametrize("history", [
    [(1, None), (2, None), (3, None), (4, None)],  # no metrics: OpenRLHF keeps the newest max_num
    [(1, 0.9), (2, None), (3, None), (4, 0.1), (5, None)],  # metric-aware: step 1 (the best) survives newer saves
])
def test_state_files_follow_openrlhfs_rotation_exactly(tmp_path, history):
    a = policy_actor(tmp_path, max_num=2)
    for i in range(len(history)):
        saves(a, history[i:i + 1])
        kept = tags(tmp_path / "_actor")  # what OpenRLHF's rotation kept, and the tag just saved
        assert f"global_step{history[i][0]}" in kept
        assert tags(tmp_path / "stare", ".json") == kept, (i, kept)
        for tag in kept:  # each file holds the controller as it was when that checkpoint was saved
            assert json.loads((tmp_path / "stare" / f"{tag}.json").read_text())["step"] == int(tag.removeprefix(
                "global_step"))
    if history[0][1] == 0.9:  # the case a newest-N rule gets wrong
        assert "global_step1" in tags(tmp_path / "_actor") and len(tags(tmp_path / "_actor")) == 2
    assert (tmp_path / "stare" / "latest").read_text() == f"global_step{history[-1][0]}"


@pytest.mark.parametrize("load_enable", [False, True])
def test_the_state_is_restored_only_when_openrlhf_loads_and_from_the_tag_deepspeed_loads(tmp_path, monkeypatch,
                                                                                       load_enable):
    a = policy_actor(tmp_path, max_num=3)
    saves(a, [(1, None), (2, None), (3, None)])
    # DeepSpeed resumes from the tag its ``latest`` names: make that step 2 while our own ``latest`` says step 3
    (tmp_path / "_actor" / "latest").write_text("global_step2")
    b = policy_actor(tmp_path, max_num=3, load_enable=load_enable)
    b.checkpoint_states = {"global_step": 2}
    fresh = Stare(step=0)
    monkeypatch.setattr(stare_actor._BasePolicyActor, "init_model_from_pretrained", lambda self, *a, **k: None)
    monkeypatch.setattr(stare_actor, "install", lambda host: ns(stare=fresh))
    printed = []
    b.strategy.print = printed.append
    b.init_model_from_pretrained(b.strategy, "model")
    if load_enable:
        assert fresh.step == 2 and printed[0] == "STARE: controller state restored from checkpoint global_step2"
    else:  # a new run in a folder with old checkpoints: OpenRLHF starts afresh, so does the controller
        assert fresh.step == 0 and printed == []
