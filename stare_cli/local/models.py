"""Where a local run's initial policy comes from: the tiny warm start, or a real small chat model."""
from __future__ import annotations

import json
from pathlib import Path

from .tasks import Task


def initial_policy(settings: dict, task: Task, cache_dir: Path, device="cpu") -> Path:
    """Folder (``from_pretrained``-loadable) of the policy the RL stage starts from (the tiny warm start is
    trained and measured on ``device``)."""
    model = settings.get("model", "tiny")
    if model == "tiny":
        return tiny_warmstart(settings, task, cache_dir, device)
    if model == "smollm2-135m":
        from .smollm import smollm_checkpoint

        return smollm_checkpoint()
    raise ValueError(f"unknown model {model!r}; valid models: tiny, smollm2-135m")


def tiny_warmstart(settings: dict, task: Task, cache_dir: Path, device="cpu") -> Path:
    from .evaluate import evaluate_policy
    from .policy import load_policy
    from .warmstart import train_warmstart

    folder = train_warmstart(task, cache_dir, seed=settings["seed"], steps=settings["warmstart_steps"],
                             batch_size=settings["warmstart_batch"], lr=settings["warmstart_lr"],
                             noise=settings["warmstart_noise"], hidden=settings["hidden"], layers=settings["layers"],
                             device=device)
    meta_path = folder / "warmstart.json"
    meta = json.loads(meta_path.read_text())
    if "eval" not in meta:  # measured once per warm start: greedy, sampled accuracy and pass@k before RL
        model, tokenizer = load_policy(folder, device)
        model.eval()
        meta["eval"] = evaluate_policy(model, tokenizer, task, n_problems=settings["eval_problems"],
                                       k=settings["eval_k"], seed=settings["seed"],
                                       max_new_tokens=settings["max_new_tokens"], temperature=settings["temperature"])
        tmp = meta_path.with_name("warmstart.json.tmp")
        tmp.write_text(json.dumps(meta, indent=2))
        tmp.replace(meta_path)
    return folder
