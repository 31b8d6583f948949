"""The warm start: a short supervised stage on noisy demonstrations, cached per seed.

It gives the RL stage a policy with moderate accuracy and real entropy, the state in which GRPO's entropy
collapse shows. The result is saved with ``save_pretrained`` in ``<cache>/`` with ``warmstart.json`` (its
settings and measured accuracy); a later run with the same settings loads it instead of training again.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from .policy import SEPARATOR, build_char_tokenizer, build_tiny_model, encode_prompts, load_policy
from .tasks import Task


def _sft_batch(tokenizer, task: Task, problems, rng: random.Random, noise: float, device: torch.device):
    texts = [tokenizer.bos_token + p.prompt + SEPARATOR + task.demonstration(p, rng, noise) + tokenizer.eos_token
             for p in problems]
    enc = tokenizer(texts, padding=True, add_special_tokens=False)
    ids = torch.tensor(enc["input_ids"], dtype=torch.long, device=device)
    attn = torch.tensor(enc["attention_mask"], dtype=torch.long, device=device)
    sep_id = tokenizer.convert_tokens_to_ids(SEPARATOR)
    # loss on the demonstration and its end token only: positions after the separator
    after_sep = (ids == sep_id).long().cumsum(-1) > 0
    labels = torch.where(after_sep & (ids != sep_id) & attn.bool(), ids, -100)
    return ids, attn, labels


def train_warmstart(task: Task, out_dir: Path, *, seed: int, steps: int, batch_size: int, lr: float, noise: float,
                    hidden: int, layers: int, progress=None, device: torch.device | str = "cpu") -> Path:
    """Train (or reuse) the warm-start policy for ``seed`` on ``device``; returns its folder.

    The cache key (``warmstart.json``'s settings) names the device when it is not the CPU: a GPU warm start is
    not bit-identical with the CPU one, so neither is ever taken for the other (keys without a device are CPU
    ones, as before the setting existed)."""
    out_dir = Path(out_dir)
    device = torch.device(device)
    settings = {"task": task.name, "seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr, "noise": noise,
                "hidden": hidden, "layers": layers}
    if device.type != "cpu":
        settings["device"] = device.type
    meta = out_dir / "warmstart.json"
    if meta.exists() and json.loads(meta.read_text()).get("settings") == settings:
        return out_dir
    tokenizer = build_char_tokenizer(task.charset)
    model = build_tiny_model(len(tokenizer), hidden=hidden, layers=layers, seed=seed,
                             pad_id=tokenizer.pad_token_id, bos_id=tokenizer.bos_token_id,
                             eos_id=tokenizer.eos_token_id).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    problems = task.problems(steps * batch_size, seed=seed, split="train")
    rng = random.Random(f"warmstart:{seed}")
    torch.manual_seed(seed)
    model.train()
    for step in range(steps):
        batch = problems[step * batch_size:(step + 1) * batch_size]
        ids, attn, labels = _sft_batch(tokenizer, task, batch, rng, noise, device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        loss = model(input_ids=ids, attention_mask=attn, position_ids=pos, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if progress is not None:
            progress(step + 1, steps)
    model.eval()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "warmstart.json").write_text(json.dumps({"settings": settings}, indent=2))
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
