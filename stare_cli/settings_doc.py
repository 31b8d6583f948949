"""What every ``--set`` key means, and its defaults: ``stare algos --settings``.

Two kinds of keys: algorithm settings (``stare.algorithms.AlgoConfig``, one default per algorithm) and run
settings (a preset's ``settings:`` block in ``configs/*.yaml``, one default per preset; GPU presets have the
typed schema of ``openrlhf_backend/argv.py``). ``--set key=value`` accepts both; tests check that every key has
a line here.
"""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stare.algorithms import ALGORITHMS, SETTING_NAMES

from .local_schema import LOCAL_SETTINGS

# One line per algorithm setting (AlgoConfig's fields).
ALGO_SETTING_HELP = {
    "std_norm": "divide group advantages by the group's reward std (false: Dr.GRPO's unnormalised advantages)",
    "clip_low": "PPO clip below: the ratio may fall to 1 - clip_low",
    "clip_high": "PPO clip above: the ratio may rise to 1 + clip_high (DAPO's clip-higher: 0.28)",
    "dual_clip": "dual clip: an A < 0 token's loss is capped at dual_clip x |A| (null: off)",
    "agg": "how token losses become one loss: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm",
    "dynamic_sampling": "drop prompts whose samples all got the same reward and sample more (DAPO)",
    "max_gen_rounds": "dynamic sampling: generation rounds per step before training on what there is",
    "overlong_shaping": "penalise responses that reach the last overlong_buffer_len tokens of the limit (DAPO)",
    "overlong_buffer_len": "overlong shaping: length of the penalised zone before the response limit, in tokens",
    "overlong_penalty": "overlong shaping: the penalty at the limit (it grows linearly across the zone)",
    "stare": "reweight selected tokens' advantages (STARE); false: a plain baseline",
    "selection": "which tokens STARE reweights: quantile (top share by surprisal, the paper) or phi (sign of "
                 "the entropy sensitivity)",
    "variant": "O1: weight W on selected A > 0 tokens only; C2: also weight M on selected A < 0 tokens",
    "top_ratio": "share of the A > 0 (and A < 0) tokens selected by surprisal, the paper's P",
    "w": "weight on the selected A > 0 tokens (raises entropy), the paper's W",
    "m": "weight on the selected A < 0 tokens (C2), the paper's M",
    "damp": "phi selection: weight on the entropy-lowering A > 0 tokens (1: untouched)",
    "phi_cap": "phi selection: keep only this top share by Phi (null: every token with the right sign)",
    "phi_tol": "phi selection: within this share of the step's mean |A Phi| of zero, a token's weight moves "
               "linearly between the two the sign of Phi picks from (0: the sign decides alone)",
    "scope": "where the selection is made: global (the step's whole batch) or micro_batch (the reference's rule)",
    "controller": "the entropy gate: paper (on while entropy < target_entropy) or band (proportional, "
                  "band_low..band_high)",
    "target_entropy": "paper gate: reweighting is on while the batch entropy is below this",
    "adaptive": "paper gate: move W and M by alpha each step towards the target (within w_max, m_min)",
    "alpha": "adaptive paper gate: step size of W and M per RL step",
    "w_max": "adaptive paper gate: the largest W",
    "m_min": "adaptive paper gate: the smallest M",
    "band_low": "band gate: full strength when the batch entropy is at or below this",
    "band_high": "band gate: top of the band; above it the gate is off (or pushes down with two_sided)",
    "band_target": "band gate: strength starts below this (null: band_high)",
    "gain": "band gate: strength per unit of shortfall (1: full strength exactly at band_low)",
    "two_sided": "band gate: above band_high, push entropy down (mirrored selection)",
    "telemetry": "what each step logs: full (entropy, shares, Phi forecasts), entropy (batch entropy only) or off",
    "stats_kernel": "kernel for the per-token entropy and Phi: auto (fused Triton on CUDA, eager torch elsewhere), "
                    "torch, triton, compiled (torch.compile fuses them on any device; a compilation per process) or "
                    "cpp (a C++ loop for the CPU, about 3.5x torch there; built once per machine with its C++ compiler)",
    "token_rule": "an entropy baseline's token rule, once per step over the whole batch: none, clip-cov, kl-cov or "
                  "80-20 (80-20 keeps the top top_ratio tokens by entropy)",
    "clip_ratio": "clip-cov: share of the response tokens whose gradient is dropped (random among the candidates)",
    "cov_low": "clip-cov: candidates have a log-prob/advantage covariance above this",
    "cov_high": "clip-cov: candidates have a log-prob/advantage covariance below this",
    "k_ratio": "kl-cov: share of the response tokens, the top ones by covariance, that get the |log-ratio| penalty",
    "kl_cov_coef": "kl-cov: coefficient of the |log p - log p_old| penalty (the surrogate is unclipped)",
    "mask_denominator": "80-20: the loss divided by the selected tokens (selected, the 80/20 paper's code) or by "
                        "every response token (all, TRL's choice)",
}

# One line per run setting of the local presets (tiny-cpu, tiny-explore, smollm-cpu): the schema's own words
# (stare.cli.local_schema.LOCAL_SETTINGS, the one table of those settings: types, defaults, valid values, meaning).
LOCAL_RUN_SETTING_HELP = {s.name: s.help for s in LOCAL_SETTINGS}

GPU_RUN_SETTING_HELP = {
    "model": "hub id or folder of the policy to train",
    "cold_start_checkpoint": "when set, RL starts from this (SFT) checkpoint instead of model",
    "data": "training prompts: hub id or a local .jsonl/.json/.parquet with problem and answer",
    "data_split": "split of a hub data set",
    "prompt_template": "the prompt; must contain {problem}",
    "apply_chat_template": "wrap the prompt in the model's chat template",
    "samples_per_prompt": "responses per prompt (the group size G)",
    "prompts_per_step": "prompts per RL step (the rollout batch)",
    "train_batch_size": "sequences per optimizer step, over all GPUs",
    "micro_batch_size": "sequences per GPU per forward/backward",
    "rollout_micro_batch_size": "sequences per GPU per log-prob forward",
    "max_prompt_len": "prompt limit in tokens",
    "max_response_len": "response limit in tokens",
    "lr": "actor learning rate",
    "warmup_ratio": "share of the steps with a learning-rate warm-up",
    "grad_clip": "gradient norm clip",
    "kl_coef": "KL penalty to a reference model (0: no reference model, the paper's recipe)",
    "temperature": "rollout sampling temperature",
    "top_p": "rollout nucleus sampling",
    "episodes": "passes over the prompt set",
    "seed": "training seed",
    "gpus_per_node": "GPUs per node",
    "nodes": "nodes",
    "vllm_engines": "vLLM rollout engines",
    "vllm_tensor_parallel": "tensor parallel size of each vLLM engine",
    "vllm_gpu_memory_utilization": "share of GPU memory vLLM may take",
    "colocate": "actor and vLLM share the GPUs (vLLM sleeps while the actor trains)",
    "zero_stage": "DeepSpeed ZeRO stage (0-3)",
    "gradient_checkpointing": "recompute activations in the backward pass to save memory",
    "packing": "pack sequences into token-budget micro-batches (needs flash-attn)",
    "max_tokens_per_gpu": "packing: the token budget of one micro-batch",
    "save_steps": "a checkpoint every N steps",
    "max_checkpoints": "checkpoints kept",
    "reward_timeout_s": "time limit for scoring one answer, in seconds",
    "wandb_project": "non-empty: also log to this W&B project ($WANDB_API_KEY)",
    "ray_dashboard": "start the Ray dashboard with the Ray head started here (off by default: it can stall a small "
                     "machine's start; a joined cluster's head decides for itself)",
    "agent": "'' (single turn) or python (multi-turn sandboxed Python tool use)",
    "tool_max_turns": "tool use: turns per episode",
    "tool_timeout_s": "tool use: time limit per code block, in seconds",
}


def _fmt(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _per_owner(values: dict[str, object]) -> str:
    """The most common value, then the owners that differ: '0.28 (grpo, dr-grpo: 0.2)'."""
    groups: dict[str, list[str]] = {}
    for owner, value in values.items():
        groups.setdefault(_fmt(value), []).append(owner)
    common = max(groups, key=lambda v: len(groups[v]))  # ties: the first seen
    others = "; ".join(f"{', '.join(owners)}: {value}" for value, owners in groups.items() if value != common)
    return f"{common} ({others})" if others else common


def algo_settings_table() -> Table:
    table = Table(title="algorithm settings (--set key=value; default per algorithm)")
    table.add_column("setting", style="bold cyan", no_wrap=True)
    table.add_column("default")
    table.add_column("meaning")
    for key in SETTING_NAMES:
        values = {name: getattr(cfg, key) for name, cfg in ALGORITHMS.items()}
        table.add_row(key, escape(_per_owner(values)), escape(ALGO_SETTING_HELP.get(key, "")))
    return table


def local_run_settings_table() -> Table:
    """The local presets' settings, from the schema (``local_schema.LOCAL_SETTINGS``): the default per preset and
    the valid values."""
    from .presets import load_preset, preset_names

    names = sorted(preset_names(), key=lambda n: (n != "tiny-cpu", n))  # the embedded default first
    presets = [p for p in (load_preset(n) for n in names) if p.backend == "local"]
    table = Table(title="run settings of the local presets (--set key=value; default per preset)")
    table.add_column("setting", style="bold cyan", no_wrap=True)
    table.add_column("default")
    table.add_column("meaning; valid values")
    for s in LOCAL_SETTINGS:
        values = {p.name: p.settings[s.name] for p in presets if s.name in p.settings}
        table.add_row(s.name, escape(_per_owner(values) if values else _fmt(s.default)),
                      escape(f"{s.help}; valid: {s.valid()}"))
    return table


def gpu_run_settings_table() -> Table:
    from .openrlhf_backend.argv import SCHEMA

    table = Table(title="run settings of the GPU presets (--set key=value; default, or required: each preset "
                        "sets it)")
    table.add_column("setting", style="bold cyan", no_wrap=True)
    table.add_column("default")
    table.add_column("meaning")
    for key, (typ, default) in SCHEMA.items():
        shown = "required" if default is ... else repr(default) if default == "" else _fmt(default)
        table.add_row(key, escape(f"{shown} ({typ.__name__})"), escape(GPU_RUN_SETTING_HELP.get(key, "")))
    return table


def local_settings_markdown() -> str:
    """docs/local-settings.md: the local presets' settings table, rendered from the schema (a test keeps the file
    equal to this; regenerate with ``python -m stare.cli.settings_doc > docs/local-settings.md``)."""
    from .local_schema import markdown_table

    return ("# Settings of the local presets\n\n"
            "Generated from `stare_cli/local_schema.py` (`LOCAL_SETTINGS`, the one table `stare algos --settings` "
            "prints too) by `python -m stare.cli.settings_doc > docs/local-settings.md`. Every local preset "
            "(`tiny-cpu`, `tiny-explore`, `smollm-cpu`) is checked against it when it is loaded and again after "
            "`--set`; a value outside it is one line naming the setting, the value and what is valid, and nothing "
            "is written. The defaults are what a preset that leaves a setting out gets; `stare algos --settings` shows each "
            "preset's own values.\n\n"
            + markdown_table())


def print_settings(console: Console) -> None:
    """Every key ``--set`` accepts, with its defaults and meaning."""
    console.print(algo_settings_table())
    console.print(local_run_settings_table())
    console.print(gpu_run_settings_table())
    console.print("A preset's own values: `stare train --preset NAME --dry-run` prints them all, resolved.")


if __name__ == "__main__":
    import sys

    sys.stdout.write(local_settings_markdown())
