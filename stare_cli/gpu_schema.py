"""The typed schema of the GPU presets' ``settings:`` (qwen-7b-short-cot, ...): one table, ``GPU_SETTINGS``.

A row per setting an ``openrlhf`` preset may hold (``stare.algorithms.settings.Setting``): name, type, default
(``REQUIRED``: every preset gives it), the valid range or choices and a one-line meaning. ``check_values`` checks
a preset's settings against it when the preset is loaded and again after ``--set``; ``stare algos --settings`` and
docs/settings.md render from it (``settings_doc``). The rules between settings that mirror OpenRLHF's own asserts
(the GPU layout, the batch sizes) are ``openrlhf_backend/argv.py``'s, which runs them after these. A new setting
is one more row here (and its flag in ``argv.build_launch``).

No torch import here: ``stare presets`` and ``stare algos`` read this module, and they must stay fast.
"""
from __future__ import annotations

from pathlib import Path

from stare.algorithms.settings import REQUIRED, Setting, check_settings, schema
from stare.eval.data import BENCHES

from .agent.sandbox import ISOLATION_MODES as SANDBOX_ISOLATION_MODES
from .local_schema import MAX_SEED, check_algos

AGENTS = ("", "python")  # "" (single turn) | "python" (the sandboxed Python tool agent)
# the tool sandbox's isolations and the benchmarks, from their homes (both modules are torch-free)
ISOLATION_MODES = SANDBOX_ISOLATION_MODES
EVAL_BENCHES = tuple(BENCHES)


class SettingsError(ValueError):
    """A preset's settings do not fit the schema (the CLI exits with code 2)."""


def _missing_path(value: str) -> bool:
    """A model setting that is a local path (not a hub id, name or owner/name) and does not exist here."""
    from .errors import looks_like_hub_id

    return not looks_like_hub_id(value) and not Path(value).expanduser().exists()


def _cold_start(value: str) -> str | None:
    if value and _missing_path(value):  # a path that is not there is not a hub id to wait for
        return (f"setting 'cold_start_checkpoint' {value}: no such folder ({Path(value).expanduser().absolute()}); "
                "expected a model folder or a hub id (name or owner/name)")
    return None


def _check_benches(value: str) -> str | None:
    benches = [b.strip() for b in value.split(",") if b.strip()]
    unknown = [b for b in benches if b not in EVAL_BENCHES]
    if unknown or not benches:
        return (f"setting 'benches' {value!r}: unknown benchmark {unknown[0] if unknown else value!r}; valid "
                f"benchmarks (comma-separated): {', '.join(EVAL_BENCHES)}")
    if len(set(benches)) != len(benches):
        return f"setting 'benches' lists a benchmark twice: {value!r}"
    return None


def _check_protocol(value: str) -> str | None:
    from stare.eval.protocols import PROTOCOLS  # no torch import: the eval package loads torch lazily

    if value not in PROTOCOLS:
        return f"setting 'eval_protocol' must be one of {', '.join(PROTOCOLS)} (stare eval --protocol), got {value!r}"
    return None


def _template(value: str) -> str | None:
    return None if "{problem}" in value else f"prompt_template must contain {{problem}}, got {value!r}"


# THE table. A check's message names the setting itself.
GPU_SETTINGS: tuple[Setting, ...] = (
    Setting("model", str, REQUIRED, "hub id or folder of the policy to train"),
    Setting("cold_start_checkpoint", str, "", "when set, RL starts from this (SFT) checkpoint instead of model",
            check=_cold_start, valid_text="'' (none), a model folder or a hub id (owner/name)"),
    Setting("data", str, REQUIRED, "training prompts: hub id or a local .jsonl/.json/.parquet with problem and answer"),
    Setting("data_split", str, "train", "split of a hub data set"),
    Setting("prompt_template", str, REQUIRED, "the prompt; must contain {problem}", check=_template,
            valid_text="text containing {problem}"),
    Setting("apply_chat_template", bool, True, "wrap the prompt in the model's chat template"),
    Setting("samples_per_prompt", int, REQUIRED, "responses per prompt (the group size G)", low=1,
            valid_text="integer >= 2"),  # 0 and below: the >= 1 message; 1: argv's layout check says why not
    Setting("prompts_per_step", int, REQUIRED, "prompts per RL step (the rollout batch)", low=1),
    Setting("train_batch_size", int, REQUIRED, "sequences per optimizer step, over all GPUs", low=1),
    Setting("micro_batch_size", int, 1, "sequences per GPU per forward/backward", low=1),
    Setting("rollout_micro_batch_size", int, 4, "sequences per GPU per log-prob forward", low=1),
    Setting("max_prompt_len", int, REQUIRED, "prompt limit in tokens", low=1),
    Setting("max_response_len", int, REQUIRED, "response limit in tokens", low=1),
    Setting("lr", float, REQUIRED, "actor learning rate", low=0.0, low_open=True),
    Setting("warmup_ratio", float, 0.0, "share of the steps with a learning-rate warm-up", low=0.0, high=1.0),
    Setting("grad_clip", float, 1.0, "gradient norm clip", low=0.0, low_open=True),
    Setting("kl_coef", float, 0.0, "KL penalty to a reference model (0: no reference model, the paper's recipe)",
            low=0.0),
    Setting("temperature", float, 1.0, "rollout sampling temperature", low=0.0, high=2.0, low_open=True),
    Setting("top_p", float, 1.0, "rollout nucleus sampling", low=0.0, high=1.0, low_open=True),
    Setting("episodes", int, 1, "passes over the prompt set", low=1),
    Setting("seed", int, 42, "training seed", low=0, high=MAX_SEED),
    Setting("seeded_rollouts", bool, True, "every rollout request carries a seed derived from seed, the step, the "
            "prompt's draw and the sample, a step's groups reach the trainer in draw order, and its update order is "
            "seeded too: a resumed run repeats the uninterrupted one, rollouts and weights (bit for bit on vLLM's "
            "CPU engine; GPUs: docs/openrlhf-backend.md, Resume); false: OpenRLHF's unseeded requests"),
    Setting("gpus_per_node", int, REQUIRED, "GPUs per node", low=1),
    Setting("nodes", int, REQUIRED, "nodes", low=1),
    Setting("vllm_engines", int, REQUIRED, "vLLM rollout engines", low=1),
    Setting("vllm_tensor_parallel", int, REQUIRED, "tensor parallel size of each vLLM engine", low=1),
    Setting("vllm_gpu_memory_utilization", float, 0.6, "share of GPU memory vLLM may take", low=0, high=1,
            low_open=True),
    Setting("vllm_enforce_eager", bool, True, "vLLM decodes without CUDA graphs (OpenRLHF's --vllm.enforce_eager; "
            "on, as the pinned OpenRLHF's own colocate + sleep example runs); false captures CUDA graphs: faster "
            "decoding, more GPU memory, and never run by this project under vLLM's sleep mode"),
    Setting("colocate", bool, True, "actor and vLLM share the GPUs (vLLM sleeps while the actor trains)"),
    Setting("gpu_memory_gib", float, 80.0, "memory of one GPU in GiB, for the memory plan every dry run shows "
            "(80 for an 80 GB A100/H100, 141 for an H200)", low=1.0),
    Setting("memory_check", str, "refuse", "a layout the memory plan says cannot fit the GPU: refuse (exit 2 "
            "before anything starts), warn (one line, then launch) or off", choices=("refuse", "warn", "off")),
    Setting("zero_stage", int, 3, "DeepSpeed ZeRO stage (0-3)", choices=(0, 1, 2, 3)),
    Setting("gradient_checkpointing", bool, True, "recompute activations in the backward pass to save memory"),
    Setting("packing", bool, True, "pack sequences into token-budget micro-batches (needs flash-attn)"),
    Setting("max_tokens_per_gpu", int, 16384, "packing: the token budget of one micro-batch", low=1),
    Setting("save_steps", int, 10, "a checkpoint every N steps", low=1),
    Setting("max_checkpoints", int, 2, "checkpoints kept", low=1),
    Setting("save_hf_checkpoints", bool, False, "also save the policy as a Hugging Face model at every checkpoint "
            "(OpenRLHF's --ckpt.save_hf: ckpt/global_step<S>_hf/, never rotated), for stare eval --checkpoints"),
    # in-training evaluation: OpenRLHF's own (--eval.*), scored by this project's reward (math-verify)
    Setting("eval_every", int, 0, "evaluate on eval_bench every N steps during training (OpenRLHF's --eval.steps; "
            "logged as eval/eval_<bench>_pass1, read by stare compare as a curve; 0: off)", low=0),
    Setting("eval_bench", str, "aime24", "the benchmark of the in-training evaluation (its shipped or "
            "$STARE_DATA_DIR copy, in the training prompt template)", choices=EVAL_BENCHES),
    Setting("eval_samples_per_prompt", int, 4, "in-training evaluation: samples per problem (pass1 is their mean "
            "reward: avg@n)", low=1),
    Setting("eval_temperature", float, 0.6, "in-training evaluation: sampling temperature (top_p and the response "
            "limit are the rollout's)", low=0.0, high=2.0),
    Setting("reward_timeout_s", float, 5.0, "time limit for scoring one answer, in seconds", low=0.0,
            low_open=True),
    Setting("wandb_project", str, "", "non-empty: also log to this W&B project ($WANDB_API_KEY)"),
    Setting("ray_dashboard", bool, False, "start the Ray dashboard with the Ray head started here (off by default: it "
            "can stall a small machine's start; a joined cluster's head decides for itself)"),
    # stare run: the arms, seeds and evaluation of the comparison (nothing a training reads)
    Setting("algos", str, "grpo,dapo,stare", "stare run: the arms trained (comma-separated algorithms)",
            check=check_algos, valid_text="comma-separated algorithms (stare algos)"),
    Setting("seeds", int, 1, "stare run: seeds per arm (seed, seed + 1, ...)", low=1),
    Setting("benches", str, "aime24,aime25", "stare run: the benchmarks each final model is evaluated on (stare "
            "eval --bench; the flag --bench overrides)", check=_check_benches,
            valid_text="comma-separated benchmarks of stare eval"),
    Setting("eval_protocol", str, "stare", "stare run: the sampling protocol of those evaluations (stare eval "
            "--protocol: k, temperature, top_p, response limit)", check=_check_protocol,
            valid_text="a protocol of stare eval --protocol"),
    # multi-turn tool use (the qwen-7b-tool-use preset)
    Setting("agent", str, "", "'' (single turn) or python (multi-turn sandboxed Python tool use)", choices=AGENTS),
    Setting("tool_max_turns", int, 4, "tool use: turns per episode", low=1),
    Setting("tool_timeout_s", float, 10.0, "tool use: time limit per code block, in seconds", low=0.0,
            low_open=True),
    Setting("sandbox_isolation", str, "namespaces", "tool use: the sandbox's isolation (STARE_SANDBOX_ISOLATION in "
            "the workers): namespaces (user, network, pid, mount namespaces; the run stops in one line where the "
            "machine has none), auto (namespaces when available, else the audit-hook fallback) or basic (the "
            "fallback)", choices=ISOLATION_MODES),
)
SCHEMA: dict[str, Setting] = schema(GPU_SETTINGS)


def check_values(settings: dict, source: str, *, given: dict[str, str] | None = None) -> dict:
    """Check an openrlhf preset's settings against ``GPU_SETTINGS`` (names, types, each value's range, choices and
    check: ``check_settings``, the same check and message shape as the local presets') and fill the defaults.
    Returns a new dict; ``SettingsError`` naming ``source`` (and a --set key as ``--set key=TEXT``) otherwise."""
    try:
        return check_settings(GPU_SETTINGS, settings, f"preset {source}: ", given=given)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
