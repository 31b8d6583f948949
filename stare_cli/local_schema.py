"""The typed schema of the local presets' ``settings:`` (tiny-cpu, tiny-explore, smollm-cpu): one table.

``LOCAL_SETTINGS`` below is the one list of every setting a local preset may hold, a row each
(``stare.algorithms.settings.Setting``, the row the algorithm and GPU tables use too): name, type, default, the
valid range or choices, and a one-line meaning. ``check_local_settings`` checks a preset's settings against it
when the preset is loaded, and again after ``--set`` (so ``stare train --dry-run`` refuses what training would
refuse; ``Setting.parse`` reads the ``--set`` text); ``stare algos --settings``, docs/local-settings.md and
docs/settings.md render from it (``settings_doc``). A new setting is one more row here (and a value in the
presets that want another than the default).

No torch import here: ``stare presets`` and ``stare algos`` read this module, and they must stay fast.
"""
from __future__ import annotations

from stare.algorithms.settings import Setting, check_settings, schema, setting_label

DEVICES = ("auto", "cpu", "cuda")  # local/device.py resolves them; the names live here (no torch import)
TASKS = ("reverse", "explore", "arith")  # local/tasks.py TASKS implements each, under these names
MODELS = ("tiny", "smollm2-135m")  # local/models.py initial_policy
TINY_HEADS = 4  # local/policy.py build_tiny_model: attention heads of the tiny model (hidden must divide by it)
MAX_SEED = 2**32 - 1


def check_algos(value: str) -> str | None:
    """The ``algos`` setting: ``registry.parse_algorithm_list``'s line, or None when the list is good."""
    from stare.algorithms.registry import parse_algorithm_list

    try:
        parse_algorithm_list(value)
    except ValueError as exc:
        return str(exc)
    return None


# THE table: every setting a local preset may hold. Defaults: the embedded tiny-cpu preset's first values; a preset
# sets what differs (stare algos --settings shows each preset's own).
LOCAL_SETTINGS: list[Setting] = [
    Setting("task", str, "reverse", "the task: reverse (strings), explore (reversal with a rare trigger rule), arith "
            "(sums, in a chat turn)", choices=TASKS),
    Setting("model", str, "tiny", "tiny (a Llama built from a config) or smollm2-135m (the packaged "
            "SmolLM2-135M-Instruct)", choices=MODELS),
    Setting("seed", int, 0, "seed of the first arm; stare run adds 1 per extra seed", low=0, high=MAX_SEED),
    Setting("algos", str, "grpo,dapo,stare,stare-phi", "stare run: the arms trained (comma-separated algorithms)",
            check=check_algos, valid_text="comma-separated algorithms (stare algos)"),
    Setting("seeds", int, 1, "stare run: seeds per arm", low=1),
    Setting("steps", int, 200, "RL steps per arm", low=1),
    Setting("prompts_per_step", int, 16, "prompts sampled per RL step", low=1),
    Setting("samples_per_prompt", int, 8, "responses per prompt (the group size G)", low=2),
    Setting("mini_batches", int, 2, "optimizer steps per RL step", low=1),
    Setting("micro_batch_size", int, 64, "sequences per forward/backward (gradients accumulated with global counts)",
            low=1),
    Setting("lr", float, 0.001, "AdamW learning rate", low=0.0, low_open=True),
    Setting("grad_clip", float, 1.0, "gradient norm clip", low=0.0, low_open=True),
    Setting("temperature", float, 1.0, "sampling temperature of the rollouts", low=0.0, high=2.0, low_open=True),
    Setting("max_new_tokens", int, 9, "the response limit in tokens (cut responses score 0)", low=1),
    Setting("train_problems", int, 4000, "size of the training problem set", low=1),
    Setting("eval_problems", int, 200, "held-out problems evaluated after training", low=1),
    Setting("eval_k", int, 8, "samples per held-out problem (avg@k, pass@k)", low=1),
    Setting("save_every", int, 25, "a checkpoint every N steps (what --resume continues from)", low=1),
    Setting("keep_checkpoint_every", int, 0, "also keep the policy of every N-th step (and of the last) in "
            "checkpoints/step-<S>/, for stare eval --checkpoints (0: off; the files only, no numbers move)", low=0),
    Setting("eval_every", int, 0, "held-out avg@k every N steps during training, logged as heldout/* in "
            "metrics.jsonl and drawn by stare compare (0: off; its own sampling stream, so the training numbers "
            "do not move)", low=0),
    Setting("threads", int, 1, "torch threads per arm", low=1),
    Setting("device", str, "cpu", "where the local engine trains: cpu (default: the README's numbers), cuda (one GPU) "
            "or auto", choices=DEVICES),
    Setting("logits_to_keep", bool, False, "training pass: LM head on the response positions only (true) or on every "
            "position (false; same logits, weight gradient equal up to rounding: the tiny presets keep false, their "
            "README numbers)"),
    Setting("same_batch_entropy", bool, True, "one more no-grad forward per step to log "
            "stare/entropy_change_same_batch (false: absent)"),
    Setting("hidden", int, 64, f"tiny model: hidden size (a multiple of its {TINY_HEADS} attention heads)",
            low=TINY_HEADS, check=lambda v: None if v % TINY_HEADS == 0 else
            f"expected a multiple of {TINY_HEADS} (the tiny model's attention heads), got {v}",
            valid_text=f"integer >= {TINY_HEADS}, a multiple of {TINY_HEADS}"),
    Setting("layers", int, 2, "tiny model: transformer layers", low=1),
    Setting("warmstart_steps", int, 600, "tiny model: supervised warm-start steps before RL", low=0),
    Setting("warmstart_batch", int, 64, "tiny model: warm-start batch size", low=1),
    Setting("warmstart_lr", float, 0.003, "tiny model: warm-start learning rate", low=0.0, low_open=True),
    Setting("warmstart_noise", float, 0.8, "tiny model: chance that a warm-start demonstration has one wrong "
            "character", low=0.0, high=1.0),
]
SCHEMA: dict[str, Setting] = schema(LOCAL_SETTINGS)


class LocalSettingsError(ValueError):
    """A local preset's settings (or a --set of them) do not fit the schema (the CLI exits with code 2)."""


def check_local_settings(settings: dict, where: str, *, given: dict[str, str] | None = None) -> dict:
    """Check a local preset's settings against ``LOCAL_SETTINGS`` and fill the defaults (``check_settings``, the
    same check and message shape as the GPU presets'), then the rules between settings; returns a new dict.

    ``where`` starts each message ("preset tiny-cpu.yaml: "); a key in ``given`` (the keys the user set with --set,
    with the text given) is reported as ``--set key=TEXT``."""
    try:
        out = check_settings(LOCAL_SETTINGS, settings, where, given=given)
    except ValueError as exc:
        raise LocalSettingsError(str(exc)) from None
    # rules between settings
    if out["prompts_per_step"] > out["train_problems"]:
        key = "prompts_per_step" if given and "prompts_per_step" in given else "train_problems"
        raise LocalSettingsError(f"{where}{setting_label(key, given)}: prompts_per_step ({out['prompts_per_step']}) "
                                 f"must be <= train_problems ({out['train_problems']}): a step samples its prompts "
                                 "from the training set without repeats")
    return out
