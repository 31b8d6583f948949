"""From a resolved preset + algorithm to a ``train_ppo_ray`` argument list of the pinned OpenRLHF.

Pure data work, no import of OpenRLHF or Ray: ``stare train --dry-run`` prints what this builds, and the tests
feed every preset x algorithm through OpenRLHF's real parser.

What goes where:
- Everything OpenRLHF has a flag for (model, data, batch sizes, lengths, clip range, dual clip, loss
  aggregation, dynamic filtering, overlong shaping, Ray/vLLM/DeepSpeed layout) is a flag in ``openrlhf_argv``.
- STARE's own settings (selection, W/M, controller, scope) have no OpenRLHF flag, and its parser rejects
  unknown flags, so they travel to the workers as JSON in the ``STARE_SETTINGS`` environment variable (set in
  the Ray runtime environment). Baselines get the same plugin with ``stare: false``: their loss is OpenRLHF's
  own, and they log the same entropy telemetry, so curves compare like with like. The entropy baselines
  (clip-cov, kl-cov, 80-20) apply their token rule in the plugin; the dry run prints its settings under "stare".
  KL-Cov's surrogate is unclipped: ``--actor.eps_clip_low_high inf inf`` and no ``--actor.dual_clip``.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from stare.algorithms import AlgoConfig
from stare.algorithms.registry import BONUS_SETTINGS, STARE_OWN_SETTINGS

from ..gpu_schema import SettingsError, check_values  # the GPU presets' settings table
from ..rundir import CKPT, FINAL, TENSORBOARD

SETTINGS_ENV = "STARE_SETTINGS"
DASHBOARD_ENV = "STARE_RAY_DASHBOARD"  # 1: the local Ray head starts its dashboard (the ray_dashboard setting)
REWARD_TIMEOUT_ENV = "STARE_REWARD_TIMEOUT_S"
# every Ray worker of a run starts with torch's generator seeded from the run's seed (launch.seed_worker, Ray's
# worker_process_setup_hook): OpenRLHF's prompt loader draws its shuffling seed from that generator, which torch
# otherwise seeds at random in each new process, so two runs with one seed would see the prompts in other orders
SEED_ENV = "STARE_SEED"
SEED_HOOK = "stare.cli.openrlhf_backend.launch.seed_worker"
# 1 (the default, the seeded_rollouts setting) or 0: whether the trainer actor seeds every rollout request and hands
# a step's groups on in prompt-draw order (rollouts.StarePPOTrainer), and the policy actor seeds each step's update
# order (step.StareStep.seed_update_order); both read it in their workers (seeds.seeded_rollouts_on)
SEEDED_ROLLOUTS_ENV = "STARE_SEEDED_ROLLOUTS"
PROMPT_FILE = "data/train.jsonl"  # relative to the run directory; written by stare train before launch


def eval_file(bench: str) -> str:
    """The in-training evaluation's prompt file, relative to the run directory (written by stare train before
    launch, as PROMPT_FILE, with a ``datasource`` per row: OpenRLHF logs eval/eval_<datasource>_pass1)."""
    return f"data/eval-{bench}.jsonl"

# Our loss aggregations -> OpenRLHF's --actor.loss_agg_mode (Dr.GRPO's constant-length sum has no OpenRLHF
# mode; token-mean is the nearest, and the dry-run says so in "notes").
AGG_MODES = {"token-mean": "token-mean", "seq-mean-token-mean": "seq-mean-token-mean",
             "seq-mean-token-sum-norm": "token-mean"}


def check_settings(settings: dict, source: str, *, given: dict[str, str] | None = None) -> dict:
    """Check an openrlhf preset's settings (the schema's rows, ``stare_cli/gpu_schema.py``, then the layout rules
    below) and fill defaults. Returns a new dict; ``given``: the keys set with --set, with the text given (named so
    in a message)."""
    out = check_values(settings, source, given=given)
    _check_layout(out, source)
    return out


def _check_layout(s: dict, source: str) -> None:
    """What the pinned OpenRLHF would assert (or hang on) at run time, decided by the settings alone.

    Each check names the OpenRLHF (or DeepSpeed) code it mirrors. The actor ranks are gpus_per_node x nodes: we
    pass no ring attention or DeepSpeed tensor parallelism, so each rank is one data-parallel rank. With
    ``packing`` (OpenRLHF's --train.dynamic_batch_enable) OpenRLHF itself deals the rollout out in a multiple of
    the ranks (experience_maker.py split_rollout_samples, experience.py balance_experiences) and agrees the
    training micro-batches over the ranks (replay_buffer.py setup_dynamic_batch). Left unguarded, because the
    prompt count decides it: the last rollout of a pass over the prompts is shorter when the prompt set is not
    a multiple of prompts_per_step, and with packing off it may then not divide over the ranks.
    """
    ranks = s["gpus_per_node"] * s["nodes"]
    layout = f"gpus_per_node x nodes ({s['gpus_per_node']} x {s['nodes']} = {ranks} actor ranks)"
    rollout = s["prompts_per_step"] * s["samples_per_prompt"]
    rollout_text = f"prompts_per_step x samples_per_prompt ({s['prompts_per_step']} x {s['samples_per_prompt']} = {rollout})"
    # train_ppo_ray.py __main__: every estimator we map to (group_norm, dr_grpo) and dynamic filtering assert
    # n_samples_per_prompt > 1 (the group baseline makes every advantage 0 with one sample)
    if s["samples_per_prompt"] < 2:
        raise SettingsError(f"preset {source}: samples_per_prompt must be >= 2 (every algorithm's advantage is "
                            f"relative to its group of samples), got {s['samples_per_prompt']}")
    # train_ppo_ray.py train(): with colocate_all the actor ranks and the vLLM GPUs must be the same GPUs
    if s["colocate"] and s["vllm_engines"] * s["vllm_tensor_parallel"] != ranks:
        raise SettingsError(f"preset {source}: with colocate, vllm_engines x vllm_tensor_parallel "
                            f"({s['vllm_engines']} x {s['vllm_tensor_parallel']}) must equal the GPUs ({ranks})")
    # our rule, not an OpenRLHF assert: one rollout is a whole number of optimizer steps (OpenRLHF's
    # replay_buffer.py setup_dynamic_batch floors rollout // train.batch_size and leaves the rest untrained)
    if rollout % s["train_batch_size"]:
        raise SettingsError(f"preset {source}: {rollout_text} must be a multiple "
                            f"of train_batch_size ({s['train_batch_size']})")
    # train_ppo_ray.py __main__: "The number of sample batches must be greater than or equal to the effective
    # number of actor processes" (rollout // rollout micro-batch >= ranks; launcher.py async_run_method_batch
    # raises on fewer chunks than ranks)
    if rollout // s["rollout_micro_batch_size"] < ranks:
        raise SettingsError(f"preset {source}: {rollout_text} // rollout_micro_batch_size "
                            f"({s['rollout_micro_batch_size']}) = {rollout // s['rollout_micro_batch_size']} "
                            f"rollout micro-batches must be >= {layout}")
    if not s["packing"] and ranks > 1 and rollout % (s["rollout_micro_batch_size"] * ranks):
        # experience_maker.py split_rollout_samples cuts the rollout into micro-batches of
        # rollout_micro_batch_size, and launcher.py async_run_method_batch deals them out in chunks of
        # ceil(count / ranks): unless the rollout is a multiple of rollout_micro_batch_size x ranks, some rank
        # gets fewer forwards (ZeRO-3's forward is collective: the others wait forever in
        # PartitionedParameterCoordinator) or fewer samples to train on (its optimizer-step all-reduces in
        # loss_utils.py iter_grad_accum_global_norm never meet the others'), whatever the ZeRO stage
        per = s["rollout_micro_batch_size"] * ranks
        raise SettingsError(f"preset {source}: with packing off, {rollout_text} must be a multiple of "
                            f"rollout_micro_batch_size x gpus_per_node x nodes ({s['rollout_micro_batch_size']} x "
                            f"{s['gpus_per_node']} x {s['nodes']} = {per}), or the actor ranks get unequal "
                            "micro-batches and the step hangs")
    if s["packing"] and s["train_batch_size"] < ranks:
        # replay_buffer.py setup_dynamic_batch: train.batch_size // dp_size sequences per rank and step, a
        # ZeroDivisionError when it is 0
        raise SettingsError(f"preset {source}: with packing, train_batch_size ({s['train_batch_size']}) must be "
                            f">= {layout}")
    if not s["packing"] or s["kl_coef"] > 0:
        # DeepSpeed's config batch assertion (runtime/config.py _batch_assertion): train_batch_size ==
        # micro_batch_size x gradient accumulation x ranks, for the actor without packing
        # (deepspeed.py get_ds_train_config) and for the reference model whenever there is one
        # (get_ds_eval_config passes train_batch_size and micro_batch_size with packing too)
        per = s["micro_batch_size"] * ranks
        if s["train_batch_size"] % per:
            why = "with packing off" if not s["packing"] else "with kl_coef > 0 (a reference model)"
            raise SettingsError(f"preset {source}: {why}, train_batch_size ({s['train_batch_size']}) must be a "
                                f"multiple of micro_batch_size x gpus_per_node x nodes ({s['micro_batch_size']} x "
                                f"{s['gpus_per_node']} x {s['nodes']} = {per})")


def check_algorithm(s: dict, algo: dict, source: str) -> None:
    """The checks that need the algorithm's settings too (known once ``presets.resolve`` has merged them)."""
    # length_penalty.py apply_overlong_penalty asserts max_new_tokens >= overlong_buffer_len, at the first step's
    # reward shaping (minutes into a GPU run); max_new_tokens is our max_response_len
    if algo["overlong_shaping"] and algo["overlong_buffer_len"] > s["max_response_len"]:
        raise SettingsError(f"preset {source}, algorithm {algo['name']}: overlong_buffer_len "
                            f"({algo['overlong_buffer_len']}) must be <= max_response_len ({s['max_response_len']}), "
                            "(the penalised zone is the end of the response limit)")


def _fmt(value) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def build_launch(resolved: dict, out: Path | str, *, ray_address: str | None = None, reward_file: str,
                 agent_file: str | None = None) -> dict:
    """The launch plan for one run: ``openrlhf_argv``, ``command``, ``stare``, ``ray`` (and ``notes``).

    ``resolved`` is what ``stare.cli.presets.resolve`` returns for an openrlhf preset; ``out`` the run
    directory (checkpoints, final model, TensorBoard logs and the prepared prompt file live under it).
    """
    s = resolved["settings"]
    algo = resolved["algo"]
    check_algorithm(s, algo, resolved["preset"])
    out = Path(out)
    notes: list[str] = []
    run_name = f"{resolved['preset']}-{algo['name']}"
    a: list[str] = []

    def flag(name: str, *values) -> None:
        a.append(f"--{name}")
        a.extend(_fmt(v) for v in values)

    # model and data
    if s["agent"] and not s["cold_start_checkpoint"]:
        raise SettingsError(f"preset {resolved['preset']!r} trains a tool agent from a cold-start SFT checkpoint; "
                            "pass --set cold_start_checkpoint=PATH (a folder or hub id)")
    flag("actor.model_name_or_path", s["cold_start_checkpoint"] or s["model"])
    flag("data.prompt_dataset", str(out / PROMPT_FILE))
    flag("data.input_key", "prompt")
    flag("data.label_key", "label")
    if s["apply_chat_template"]:
        flag("data.apply_chat_template")
    flag("data.max_len", s["max_prompt_len"] + s["max_response_len"])
    # reward: math-verify on the last boxed answer (or the tool agent, which scores the same way)
    if s["agent"]:
        flag("train.agent_func_path", agent_file)
    else:
        flag("reward.remote_url", reward_file)
    # rollout
    flag("rollout.n_samples_per_prompt", s["samples_per_prompt"])
    flag("rollout.batch_size", s["prompts_per_step"])
    flag("rollout.micro_batch_size", s["rollout_micro_batch_size"])
    flag("rollout.max_new_tokens", s["max_response_len"])
    flag("rollout.temperature", s["temperature"])
    flag("rollout.top_p", s["top_p"])
    # optimisation
    flag("train.batch_size", s["train_batch_size"])
    flag("train.micro_batch_size", s["micro_batch_size"])
    flag("train.max_epochs", 1)
    flag("train.num_episodes", s["episodes"])
    flag("train.seed", s["seed"])
    flag("actor.adam.lr", s["lr"])
    flag("actor.lr_warmup_ratio", s["warmup_ratio"])
    flag("actor.max_norm", s["grad_clip"])
    # the algorithm
    flag("algo.advantage.estimator", "group_norm" if algo["std_norm"] else "dr_grpo")
    cfg = AlgoConfig(**algo)
    rule = cfg.rule  # the entropy baseline's token rule ("none" for the others)
    if rule.unclipped:
        # KL-Cov's surrogate is -A r for every token: OpenRLHF's clip range made infinite (its clamp is then the
        # identity) and no dual clip; the plugin sets the same on the loss it wraps
        flag("actor.eps_clip_low_high", float("inf"), float("inf"))
        notes.append(f"{algo['name']}: unclipped surrogate (-A r for every token): --actor.eps_clip_low_high inf inf "
                     "and no --actor.dual_clip; clip_low/clip_high/dual_clip are not used")
    else:
        flag("actor.eps_clip_low_high", algo["clip_low"], algo["clip_high"])
        if algo["dual_clip"] is not None:
            flag("actor.dual_clip", algo["dual_clip"])
    flag("actor.loss_agg_mode", AGG_MODES[algo["agg"]])
    if cfg.entropy_bonus:
        # OpenRLHF's own entropy term (the current policy's entropy, aggregated as the loss); the plugin sets the
        # coefficient each step (entropy_adaptive: controllers.EntropyCoef), starting from this one
        flag("actor.entropy_coef", algo["entropy_coef"])
    if algo["agg"] == "seq-mean-token-sum-norm":
        notes.append("OpenRLHF has no seq-mean-token-sum-norm aggregation; Dr.GRPO runs with token-mean")
    if algo["dynamic_sampling"]:
        flag("algo.dynamic_filtering_enable")
        flag("algo.dynamic_filtering_range", 0.0, 1.0)
    if algo["overlong_shaping"]:
        flag("reward.overlong_buffer_len", algo["overlong_buffer_len"])
        flag("reward.overlong_penalty_factor", algo["overlong_penalty"])
    flag("algo.kl.init_coef", s["kl_coef"])
    if s["kl_coef"] > 0:
        flag("algo.kl.use_loss")
        flag("algo.kl.estimator", "k3")
        flag("ref.num_nodes", s["nodes"])
        flag("ref.num_gpus_per_node", s["gpus_per_node"])
    # hardware layout
    flag("actor.num_nodes", s["nodes"])
    flag("actor.num_gpus_per_node", s["gpus_per_node"])
    flag("vllm.num_engines", s["vllm_engines"])
    flag("vllm.tensor_parallel_size", s["vllm_tensor_parallel"])
    flag("vllm.gpu_memory_utilization", s["vllm_gpu_memory_utilization"])
    if s["vllm_enforce_eager"]:
        flag("vllm.enforce_eager")  # no CUDA graphs (sleep mode + captured graphs + CUDA-IPC weight loads: untried)
    if s["colocate"]:
        flag("train.colocate_all")
        flag("vllm.enable_sleep")
        flag("ds.enable_sleep")
    flag("ds.zero_stage", s["zero_stage"])
    flag("ds.param_dtype", "bf16")
    if s["gradient_checkpointing"]:
        flag("actor.gradient_checkpointing_enable")
    if s["packing"]:
        flag("ds.packing_samples")
        flag("train.dynamic_batch_enable")
        flag("train.max_tokens_per_gpu", s["max_tokens_per_gpu"])
    # in-training evaluation (train_ppo_ray.py: --eval.dataset needs --reward.remote_url or --train.agent_func_path,
    # which every run has); OpenRLHF's best-checkpoint saving, on by default with an eval set, is turned off: a full
    # DeepSpeed checkpoint per improvement is not what eval_every asks for
    if s["eval_every"]:
        flag("eval.dataset", str(out / eval_file(s["eval_bench"])))
        flag("eval.steps", s["eval_every"])
        flag("eval.n_samples_per_prompt", s["eval_samples_per_prompt"])
        flag("eval.temperature", s["eval_temperature"])
        flag("ckpt.best_metric_key", "none")
    # outputs: checkpoints (resumed automatically when present), final model, logs
    flag("ckpt.path", str(out / CKPT))
    flag("ckpt.save_steps", s["save_steps"])
    flag("ckpt.max_num", s["max_checkpoints"])
    if s["save_hf_checkpoints"]:
        flag("ckpt.save_hf")
    flag("ckpt.load_enable")
    flag("ckpt.output_dir", str(out / FINAL))
    flag("logger.tensorboard_dir", str(out / TENSORBOARD))
    flag("logger.wandb.run_name", run_name)
    if s["wandb_project"]:
        flag("logger.wandb.project", s["wandb_project"])
        flag("logger.wandb.key", "${WANDB_API_KEY}")  # substituted from the environment at launch

    stare = {}
    if algo["stare"]:
        stare = {k: algo[k] for k in ("name", *STARE_OWN_SETTINGS, "telemetry")}  # every STARE field, from its owner
    elif rule.active:  # an entropy baseline: the plugin applies its token rule once per step (the dry run prints
        # the settings the rule reads)
        stare = {k: algo[k] for k in ("name", "token_rule", *rule.settings, "telemetry")}
    if cfg.entropy_bonus:  # the bonus's settings, beside the rest
        stare = {"name": algo["name"], **stare, **{k: algo[k] for k in BONUS_SETTINGS},
                 "telemetry": algo["telemetry"]}
    env = {SETTINGS_ENV: json.dumps({"algo": algo, "run": run_name}, sort_keys=True),
           REWARD_TIMEOUT_ENV: _fmt(s["reward_timeout_s"]),
           SEED_ENV: str(s["seed"]),
           SEEDED_ROLLOUTS_ENV: "1" if s["seeded_rollouts"] else "0",
           "TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}
    if s["agent"]:
        env["STARE_TOOL_MAX_TURNS"] = str(s["tool_max_turns"])
        env["STARE_TOOL_TIMEOUT_S"] = _fmt(s["tool_timeout_s"])
        env["STARE_SANDBOX_ISOLATION"] = s["sandbox_isolation"]
    ray = {"address": ray_address, "start_local_head": not ray_address,  # no address: a head starts here
           "dashboard": s["ray_dashboard"], "runtime_env": {"env_vars": env, "worker_process_setup_hook": SEED_HOOK}}
    if ray_address and s["ray_dashboard"]:
        notes.append("ray_dashboard: joining a cluster, whose head decides on its dashboard "
                     "(ray start --head --include-dashboard=true)")
    # the driver's own variables (not the workers'): launch.main reads them when the command is pasted
    driver = {DASHBOARD_ENV: "1" if s["ray_dashboard"] else "0"}
    if ray_address:
        driver = {"RAY_ADDRESS": ray_address, **driver}
    env_prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in {**driver, **env}.items())
    command = f"{env_prefix} python -m stare.cli.openrlhf_backend.launch " + shlex.join(a)
    return {"openrlhf_argv": a, "command": command, "stare": stare, "ray": ray, "notes": notes,
            "preset": resolved["preset"], "algo": algo["name"], "out": str(out)}
