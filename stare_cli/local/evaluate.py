"""Held-out evaluation of a local policy: avg@k, pass@k and greedy accuracy (overall and on hard cases).

``eval.json`` shares its field names with ``stare eval``'s ``summary.json``: ``k``, ``n_problems``, ``avg_at_k``,
``pass_at_k`` (and ``greedy_accuracy``, which only the local engine measures). The names with k in them
(``avg_at_8``, ``pass_at_8``) are written too, for a deprecation period: read ``avg_at_k`` in new code.
"""
from __future__ import annotations

import torch

from stare.eval import avg_at_k, pass_at_k_mean

from .policy import encode_prompts, sample
from .tasks import Task


@torch.no_grad()
def evaluate_policy(model, tokenizer, task: Task, *, n_problems: int, k: int, seed: int, max_new_tokens: int,
                    temperature: float = 1.0, chat: bool = False, batch_prompts: int = 64,
                    per_problem: bool = False) -> dict:
    """avg@k, pass@k and greedy accuracy on ``n_problems`` held-out problems (overall, and on the hard and easy cases
    when the task has hard ones); ``per_problem``: also each problem's share of correct samples (``per_problem``,
    for an interval), which eval.json does not hold."""
    problems = task.problems(n_problems, seed=seed, split="test")
    device = next(model.parameters()).device  # everything on the model's device
    gen = torch.Generator(device).manual_seed(10_000 + seed)
    correct, greedy = [], []
    for start in range(0, len(problems), batch_prompts):
        batch = problems[start:start + batch_prompts]
        ids, attn = encode_prompts(tokenizer, [p.prompt for p in batch], chat=chat, device=device)
        g = sample(model, tokenizer, ids, attn, max_new_tokens=max_new_tokens, greedy=True)
        greedy += [task.reward(p, t) for p, t in zip(batch, g.texts)]
        r = sample(model, tokenizer, ids, attn, repeats=k, max_new_tokens=max_new_tokens, temperature=temperature,
                   generator=gen)
        for i, p in enumerate(batch):
            correct.append([task.reward(p, t) for t in r.texts[i * k:(i + 1) * k]])

    def summarise(rows: list[int]) -> dict:
        if not rows:
            return {}
        avg, pas = avg_at_k([correct[i] for i in rows]), pass_at_k_mean([correct[i] for i in rows], k)
        # avg_at_k / pass_at_k as in stare eval's summary.json; avg_at_{k} / pass_at_{k} are the older names, still
        # written for the scripts that read them (deprecated)
        return {"n_problems": len(rows), "avg_at_k": avg, "pass_at_k": pas, f"avg_at_{k}": avg, f"pass_at_{k}": pas,
                "greedy_accuracy": sum(greedy[i] for i in rows) / len(rows)}

    out = {"k": k, "temperature": temperature, **summarise(list(range(len(problems))))}
    if per_problem:
        out["per_problem"] = [sum(row) / len(row) for row in correct]
    hard = [i for i, p in enumerate(problems) if p.hard]
    if hard:
        out["hard"] = summarise(hard)
        out["easy"] = summarise([i for i, p in enumerate(problems) if not p.hard])
    return out
