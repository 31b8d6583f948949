"""Every GPU preset x algorithm: the argument list `stare train --dry-run` prints is accepted by the pinned
OpenRLHF's own parser and its argument checks (its train_ppo_ray module run for real, stopped at ray.init)."""
from __future__ import annotations

import json
import math
import runpy
import sys

import pytest

from stare.algorithms import ALGORITHMS, AlgoConfig
from stare.cli.openrlhf_backend import launch as orl
from stare.cli.openrlhf_backend.argv import SETTINGS_ENV
from stare.cli.presets import load_preset, preset_names, resolve

pytest.importorskip("openrlhf")
pytest.importorskip("ray")
import openrlhf_standins  # noqa: E402

openrlhf_standins.install()

GPU_PRESETS = [n for n in preset_names() if load_preset(n).backend == "openrlhf"]
EXTRA_SETS = {"qwen-7b-tool-use": ["cold_start_checkpoint=owner/qwen2.5-7b-sft"]}  # a hub id (a path must exist)


class ReachedRayInit(Exception):
    pass


def parse_with_openrlhf(argv: list[str], monkeypatch) -> object:
    """Run ``python -m openrlhf.cli.train_ppo_ray ARGV`` in-process up to ``ray.init``; return its parsed args."""
    import ray
    from openrlhf.utils import config

    captured = {}
    real = config.hierarchize

    def spy(args):
        captured["args"] = real(args)
        return captured["args"]

    def stop(*a, **k):
        raise ReachedRayInit

    monkeypatch.setattr(config, "hierarchize", spy)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", stop)
    monkeypatch.setattr(sys, "argv", ["train_ppo_ray", *argv])
    with pytest.raises(ReachedRayInit):
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
    return captured["args"]


def test_there_are_the_eight_gpu_presets():
    assert set(GPU_PRESETS) == {"qwen-7b-short-cot", "qwen-14b-short-cot", "qwen-32b-short-cot", "qwen-1.5b-long-cot",
                                "qwen3-8b-long-cot", "qwen-7b-long-cot", "qwen-7b-tool-use", "qwen-1.5b-1gpu"}


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_every_algorithm_parses(preset, monkeypatch, tmp_path, capsys):
    for algo in ALGORITHMS:
        resolved = resolve(preset, algo, EXTRA_SETS.get(preset, []))
        plan = orl.plan(resolved, tmp_path / algo)
        args = parse_with_openrlhf(plan["openrlhf_argv"], monkeypatch)
        cfg = resolved["algo"]
        s = resolved["settings"]
        # the settings arrive where OpenRLHF reads them (kl-cov: no clip at all, its surrogate is -A r)
        if cfg["token_rule"] == "kl-cov":
            assert tuple(args.actor.eps_clip_low_high) == (math.inf, math.inf) and args.actor.dual_clip is None
        else:
            assert tuple(args.actor.eps_clip_low_high) == (cfg["clip_low"], cfg["clip_high"]), algo
            assert args.actor.dual_clip == cfg["dual_clip"]
        assert args.algo.dynamic_filtering_enable == cfg["dynamic_sampling"]
        assert args.rollout.n_samples_per_prompt == s["samples_per_prompt"]
        assert args.rollout.batch_size == s["prompts_per_step"]
        assert args.data.max_len == s["max_prompt_len"] + s["max_response_len"]
        assert args.actor.adam.lr == s["lr"]
        assert args.actor.num_gpus_per_node * args.actor.num_nodes == s["gpus_per_node"] * s["nodes"]
        # vLLM without CUDA graphs under sleep mode, as OpenRLHF's own colocate + sleep example (every preset)
        assert args.vllm.enforce_eager is s["vllm_enforce_eager"] is True and args.vllm.enable_sleep is s["colocate"]
        # OpenRLHF's entropy term (the current policy's, with its gradient) only where there is a bonus, starting
        # from the algorithm's coefficient (the plugin sets each step's)
        bonus = AlgoConfig(**cfg).entropy_bonus
        assert bonus == (algo == "entropy-adaptive")
        assert args.actor.entropy_coef == (cfg["entropy_coef"] if bonus else None)
        if cfg["overlong_shaping"]:
            assert args.reward.overlong_buffer_len == cfg["overlong_buffer_len"]
        if s["agent"]:
            assert args.train.agent_func_path.endswith("python_agent.py")
            assert args.actor.model_name_or_path == "owner/qwen2.5-7b-sft"
        else:
            assert args.reward.remote_url == [str(orl.REWARD_FILE)]
        env = plan["ray"]["runtime_env"]["env_vars"]
        assert json.loads(env[SETTINGS_ENV])["algo"]["name"] == algo
        assert bool(plan["stare"]) == (cfg["stare"] or cfg["token_rule"] != "none" or bonus)  # the plugin's settings
    capsys.readouterr()


def test_grpo_dapo_and_stare_map_to_the_intended_flags(tmp_path):
    def argv(algo, preset="qwen-7b-short-cot"):
        return orl.plan(resolve(preset, algo), tmp_path)["openrlhf_argv"]

    def value(a, flag, n=1):
        i = a.index(flag)
        return a[i + 1: i + 1 + n]

    grpo, dapo, stare = argv("grpo"), argv("dapo"), argv("stare")
    assert value(grpo, "--actor.eps_clip_low_high", 2) == ["0.2", "0.2"]
    assert "--algo.dynamic_filtering_enable" not in grpo
    assert value(grpo, "--actor.loss_agg_mode") == ["seq-mean-token-mean"]
    assert value(dapo, "--actor.eps_clip_low_high", 2) == ["0.2", "0.28"]
    # the 3k preset's own buffer (a fifth of the response limit, as DAPO's 4096 of 20480); the 20k preset's is DAPO's
    assert value(dapo, "--reward.overlong_buffer_len") == ["614"] and "--algo.dynamic_filtering_enable" in dapo
    assert value(argv("dapo", "qwen-7b-long-cot"), "--reward.overlong_buffer_len") == ["4096"]
    assert "--reward.overlong_buffer_len" not in stare and value(stare, "--actor.loss_agg_mode") == ["token-mean"]
    assert value(argv("dr-grpo"), "--algo.advantage.estimator") == ["dr_grpo"]
    big = orl.plan(resolve("qwen-32b-short-cot", "stare-c2"), tmp_path)
    assert (big["stare"]["w"], big["stare"]["m"]) == (1.05, 0.95)
    assert orl.plan(resolve("qwen-7b-short-cot", "stare-c2"), tmp_path)["stare"]["w"] == 1.1
    assert orl.plan(resolve("qwen-7b-short-cot", "grpo"), tmp_path)["stare"] == {}


def test_the_printed_command_carries_the_same_argv_and_settings(tmp_path):
    import shlex

    plan = orl.plan(resolve("qwen-1.5b-long-cot", "stare-phi", ["w=1.7"]), tmp_path, "10.0.0.1:6379")
    words = shlex.split(plan["command"])
    at = words.index("stare.cli.openrlhf_backend.launch")
    assert words[at + 1:] == plan["openrlhf_argv"]
    env = dict(w.split("=", 1) for w in words[: words.index("python")])
    assert env["RAY_ADDRESS"] == "10.0.0.1:6379"
    assert json.loads(env[SETTINGS_ENV])["algo"]["w"] == 1.7
    assert plan["ray"]["address"] == "10.0.0.1:6379" and not plan["ray"]["start_local_head"]


def test_build_launch_needs_no_openrlhf(tmp_path):
    """The dry run is pure data: it works where OpenRLHF is not installed (checked in a clean interpreter)."""
    import subprocess

    code = ("import sys; sys.modules['openrlhf'] = None; sys.modules['ray'] = None\n"
            "from stare.cli.openrlhf_backend import launch\n"
            "from stare.cli.presets import resolve\n"
            f"print(len(launch.plan(resolve('qwen-7b-short-cot', 'stare'), {str(tmp_path)!r})['openrlhf_argv']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 40


def test_launch_registers_the_stare_actor_and_passes_settings_to_the_workers(monkeypatch, tmp_path):
    """launch(): Ray gets the runtime env with STARE_SETTINGS, and OpenRLHF's driver builds our actor class."""
    import ray
    from openrlhf.trainer.ray import ppo_actor

    from stare.cli.openrlhf_backend import plugin

    resolved = resolve("qwen-7b-short-cot", "stare-phi", ["wandb_project=p"])
    plan = orl.plan(resolved, tmp_path)
    env = dict(plan["ray"]["runtime_env"]["env_vars"], WANDB_API_KEY="secret-key")
    seen = {}

    def fake_init(address=None, runtime_env=None, **kw):
        assert "runtime_env" not in seen, "Ray initialised twice"
        seen["address"], seen["runtime_env"] = address, runtime_env

    def stop_at_placement(*a, **k):  # OpenRLHF's train() after ray.init: look at what it is about to build
        frame = sys._getframe(1)
        while "PolicyModelActor" not in frame.f_globals:
            frame = frame.f_back
        seen["actor"] = frame.f_globals["PolicyModelActor"]
        seen["argv"] = list(sys.argv)
        raise ReachedRayInit

    monkeypatch.setattr(ray, "is_initialized", lambda: "runtime_env" in seen)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(orl, "check_first_worker", lambda ray, address: None)  # no Ray here to run a task on
    monkeypatch.setattr(ppo_actor, "PolicyModelActor", ppo_actor.PolicyModelActor)  # restored afterwards
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import vllm_engine

    monkeypatch.setattr(ppo_trainer, "PPOTrainer", ppo_trainer.PPOTrainer)  # register() replaces them too
    monkeypatch.setattr(vllm_engine, "RolloutRayActor", vllm_engine.RolloutRayActor)
    import openrlhf.utils

    monkeypatch.setattr(openrlhf.utils, "get_strategy", stop_at_placement)
    with pytest.raises(ReachedRayInit):
        orl.launch(plan["openrlhf_argv"], environ=env)
    assert seen["address"] is None  # no --ray-address: a local head
    workers = seen["runtime_env"]["env_vars"]
    assert json.loads(workers[SETTINGS_ENV])["algo"]["selection"] == "phi"
    assert seen["actor"].__ray_actor_class__ is plugin.StarePolicyModelActor
    assert "secret-key" in seen["argv"] and "${WANDB_API_KEY}" not in seen["argv"]


def test_launch_refuses_missing_settings_and_missing_wandb_key(tmp_path):
    plan = orl.plan(resolve("qwen-7b-short-cot", "grpo", ["wandb_project=p"]), tmp_path)
    with pytest.raises(RuntimeError, match="STARE_SETTINGS is not set"):
        orl.launch(plan["openrlhf_argv"], environ={})
    env = dict(plan["ray"]["runtime_env"]["env_vars"])
    with pytest.raises(orl.LaunchError, match="WANDB_API_KEY is not in the environment"):
        orl.launch(plan["openrlhf_argv"], environ=env)


def test_the_baselines_dry_run_prints_the_plugins_settings_and_kl_cov_is_unclipped(tmp_path, monkeypatch):
    import torch
    from openrlhf.models import PolicyLoss

    plans = {a: orl.plan(resolve("qwen-7b-short-cot", a), tmp_path / a) for a in ("clip-cov", "kl-cov", "80-20")}
    assert plans["clip-cov"]["stare"] == {"name": "clip-cov", "token_rule": "clip-cov", "clip_ratio": 2e-4,
                                          "cov_low": 1.0, "cov_high": 5.0, "telemetry": "full"}
    assert plans["80-20"]["stare"] == {"name": "80-20", "token_rule": "80-20", "top_ratio": 0.2,
                                       "mask_denominator": "selected", "telemetry": "full"}
    kl = plans["kl-cov"]
    assert kl["stare"]["token_rule"] == "kl-cov" and kl["stare"]["k_ratio"] == 2e-3
    assert any("unclipped" in n for n in kl["notes"])
    assert not any("unclipped" in n for n in plans["clip-cov"]["notes"] + plans["80-20"]["notes"])
    # OpenRLHF's own PolicyLoss, built from what its parser makes of kl-cov's argv exactly as its ActorPPOTrainer
    # builds it, is the unclipped surrogate -A r (token-mean), written out here; the DAPO-style clip would differ
    args = parse_with_openrlhf(kl["openrlhf_argv"], monkeypatch)
    loss_fn = PolicyLoss(clip_eps_low=args.actor.eps_clip_low_high[0], clip_eps_high=args.actor.eps_clip_low_high[1],
                         dual_clip=args.actor.dual_clip, token_level_loss=args.actor.loss_agg_mode == "token-mean",
                         policy_loss_type=args.actor.policy_loss_type)
    g = torch.Generator().manual_seed(0)
    logp, old = -torch.rand(4, 6, generator=g) * 3, -torch.rand(4, 6, generator=g) * 3
    adv, mask = torch.randn(4, 6, generator=g), torch.rand(4, 6, generator=g) > 0.2
    loss, clip_ratio = loss_fn(logp, old, adv, action_mask=mask)[:2]
    ratio = torch.exp(logp - old)
    assert float(loss) == pytest.approx(float((-adv * ratio)[mask].mean()), rel=1e-6)
    assert float(clip_ratio) == 0.0
    clipped = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    assert float(clipped[mask].mean()) != pytest.approx(float(loss), rel=1e-3)


def test_in_training_eval_and_hf_checkpoints_reach_openrlhfs_parser(tmp_path, monkeypatch):
    """eval_every and save_hf_checkpoints become OpenRLHF's --eval.* and --ckpt.save_hf flags, as its parser reads
    them (its own check that an eval set has a reward passes); off (every preset's default), none of them is there.
    The eval file stare train writes is the bench's problems in the training template, each with its datasource."""
    from stare.cli.openrlhf_backend.argv import eval_file
    from stare.cli.openrlhf_backend.data import prepare_eval_prompts
    from stare.eval import load_bench

    sets = ["eval_every=25", "eval_bench=aime25", "eval_samples_per_prompt=8", "eval_temperature=1.0",
            "save_hf_checkpoints=true"]
    resolved = resolve("qwen-7b-long-cot", "stare", sets)
    plan = orl.plan(resolved, tmp_path / "run")
    args = parse_with_openrlhf(plan["openrlhf_argv"], monkeypatch)
    assert args.eval.dataset == str((tmp_path / "run" / eval_file("aime25")).absolute())
    assert (args.eval.steps, args.eval.n_samples_per_prompt, args.eval.temperature) == (25, 8, 1.0)
    assert args.ckpt.save_hf is True and args.ckpt.best_metric_key == "none"
    plain = orl.plan(resolve("qwen-7b-long-cot", "stare"), tmp_path / "plain")["openrlhf_argv"]
    assert not any(a.startswith("--eval.") or a in ("--ckpt.save_hf", "--ckpt.best_metric_key") for a in plain)

    info = prepare_eval_prompts("aime25", resolved["settings"]["prompt_template"], tmp_path / "eval.jsonl")
    rows = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    problems = load_bench("aime25")
    assert info["problems"] == len(rows) == len(problems) == 30
    assert rows[0] == {"prompt": resolved["settings"]["prompt_template"].replace("{problem}", problems[0].problem),
                       "label": problems[0].answer, "datasource": "aime25"}
    with pytest.raises(Exception, match="eval_bench"):
        resolve("qwen-7b-long-cot", "stare", ["eval_bench=gsm8k"])


def test_vllm_enforce_eager_reaches_openrlhfs_parser_once_and_the_dry_run_shows_it(tmp_path, monkeypatch):
    """vllm_enforce_eager (on by default) is OpenRLHF's --vllm.enforce_eager, given once, as its parser reads it;
    false leaves it out (vLLM then captures CUDA graphs). The dry run prints it in the argv, and the CPU
    end-to-end run (its sizing plus the flags it appends) passes it exactly once."""
    import importlib.util
    import shlex
    from pathlib import Path

    from typer.testing import CliRunner

    from stare.cli.main import app

    eager = orl.plan(resolve("qwen-7b-short-cot", "stare"), tmp_path / "eager")["openrlhf_argv"]
    assert eager.count("--vllm.enforce_eager") == 1
    assert parse_with_openrlhf(eager, monkeypatch).vllm.enforce_eager is True
    graphs = orl.plan(resolve("qwen-7b-short-cot", "stare", ["vllm_enforce_eager=false"]), tmp_path / "g")
    assert "--vllm.enforce_eager" not in graphs["openrlhf_argv"]
    args = parse_with_openrlhf(graphs["openrlhf_argv"], monkeypatch)
    assert args.vllm.enforce_eager is False and args.vllm.enable_sleep is True  # still colocated and asleep

    for sets, shown in (([], 1), (["--set", "vllm_enforce_eager=false"], 0)):
        res = CliRunner().invoke(app, ["train", "--preset", "qwen-7b-short-cot", "--algo", "stare", *sets,
                                       "--dry-run", "--out", str(tmp_path / f"dry{shown}")])
        assert res.exit_code == 0, res.output
        dry = json.loads(res.stdout)
        assert dry["openrlhf_argv"].count("--vllm.enforce_eager") == shown
        assert shlex.split(dry["command"]).count("--vllm.enforce_eager") == shown

    spec = importlib.util.spec_from_file_location("loop_env", Path(__file__).parent / "openrlhf_cpu" / "loop_env.py")
    loop_env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop_env)
    cpu = orl.plan(resolve(loop_env.PRESET, "stare", loop_env.SIZING), tmp_path / "cpu")["openrlhf_argv"]
    assert [*cpu, *shlex.split(loop_env.CPU_FLAGS)].count("--vllm.enforce_eager") == 1


def test_the_dry_run_shows_every_stare_setting_the_selection_reads(tmp_path):
    """The dry run's ``stare`` block of a STARE algorithm holds each of its STARE settings with the value the run gets
    (its STARE_SETTINGS): the fields between ``stare`` and ``telemetry`` of AlgoConfig, read here from the dataclass
    (a hand list once missed phi_tol, so stare-phi's dry run did not show it)."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(AlgoConfig)]
    fields = names[names.index("stare") + 1:names.index("telemetry")]
    assert "phi_tol" in fields and "selection" in fields and "two_sided" in fields
    for algo in ("stare", "stare-phi"):
        plan = orl.plan(resolve("qwen-7b-short-cot", algo, ["phi_tol=0.02"] if algo == "stare-phi" else []),
                        tmp_path)
        sent = json.loads(plan["ray"]["runtime_env"]["env_vars"][SETTINGS_ENV])["algo"]  # what the workers read
        for key in fields:
            assert key in plan["stare"] and plan["stare"][key] == sent[key], (algo, key)
    assert orl.plan(resolve("qwen-7b-short-cot", "stare-phi", ["phi_tol=0.02"]), tmp_path)["stare"]["phi_tol"] == 0.02
