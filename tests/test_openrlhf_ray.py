"""The plugin across a real Ray boundary (CPU, a local Ray instance with one logical GPU): OpenRLHF's
PolicyModelActor, once registered, is created in a Ray worker as STARE's actor class, and the STARE settings
reach that worker through the runtime environment, as they do on a GPU cluster."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("openrlhf")
ray = pytest.importorskip("ray")
import openrlhf_standins  # noqa: E402

openrlhf_standins.install()
from openrlhf.trainer.ray import ppo_actor  # noqa: E402

from stare.algorithms import get_algorithm  # noqa: E402
from stare.cli.openrlhf_backend import launch as orl  # noqa: E402
from stare.cli.openrlhf_backend import plugin  # noqa: E402
from stare.cli.openrlhf_backend.argv import SETTINGS_ENV  # noqa: E402

TESTS = str(Path(__file__).resolve().parent)


def _probe(self):  # runs inside the Ray actor
    from stare.cli.openrlhf_backend import plugin as p

    cfg, run = p.load_settings()
    return [c.__name__ for c in type(self).__mro__], cfg.name, cfg.w, run, os.getpid()


def test_registered_actor_runs_in_a_ray_worker_with_the_settings(monkeypatch):
    settings = json.dumps({"algo": get_algorithm("stare-c2", w=1.3).to_dict(), "run": "ray-smoke"})
    environ = {SETTINGS_ENV: settings, "TOKENIZERS_PARALLELISM": "false"}
    env = orl.runtime_env(environ)  # what launch() hands Ray
    # test-only: the workers get the flash_attn / vllm stand-ins too (the GPU image has the real packages)
    env["env_vars"]["PYTHONPATH"] = TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")
    env["worker_process_setup_hook"] = "openrlhf_standins.install"
    monkeypatch.setattr(ppo_actor, "PolicyModelActor", ppo_actor.PolicyModelActor)  # restored afterwards
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import vllm_engine

    monkeypatch.setattr(ppo_trainer, "PPOTrainer", ppo_trainer.PPOTrainer)  # register() replaces them too
    monkeypatch.setattr(vllm_engine, "RolloutRayActor", vllm_engine.RolloutRayActor)
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, runtime_env=env, log_to_driver=False)
    try:
        plugin.register()
        actor = ppo_actor.PolicyModelActor.options(num_cpus=1).remote(
            world_size=1, rank=0, master_addr=None, master_port=None)
        mro, name, w, run, pid = ray.get(actor.__ray_call__.remote(_probe), timeout=240)
    finally:
        ray.shutdown()
    assert "StarePolicyModelActor" in mro and "PolicyModelActor" in mro
    assert (name, w, run) == ("stare-c2", 1.3, "ray-smoke")
    assert pid != os.getpid()  # a separate worker process
