"""Held-out evaluation of a local policy: the per-problem metrics of ``stare.eval.metrics.METRICS`` (avg@k, pass@k,
maj@k) and greedy accuracy, overall and on hard cases.

``eval.json`` shares its field names with ``stare eval``'s ``summary.json``: ``k``, ``n_problems`` and every
per-problem metric's key (``avg_at_k``, ``pass_at_k``, ``maj_at_k``), computed by the same functions
(``problem_values``; a row added to ``METRICS`` reaches eval.json too), plus ``greedy_accuracy``, which only the
local engine measures. maj@k votes over the answers the task reads (``Task.extract``). The names with k in them
(``avg_at_8``, ``pass_at_8``) are written too, for a deprecation period: read ``avg_at_k`` in new code.
"""
from __future__ import annotations

import torch

from stare.eval.metrics import problem_means, problem_values

from .policy import encode_prompts, sample
from .tasks import Task


@torch.no_grad()
def evaluate_policy(model, tokenizer, task: Task, *, n_problems: int, k: int, seed: int, max_new_tokens: int,
                    temperature: float = 1.0, chat: bool = False, batch_prompts: int = 64,
                    per_problem: bool = False) -> dict:
    """The per-problem metrics (avg@k, pass@k, maj@k) and greedy accuracy on ``n_problems`` held-out problems
    (overall, and on the hard and easy cases when the task has hard ones); ``per_problem``: also each problem's share of correct samples (``per_problem``,
    for an interval), which eval.json does not hold."""
    problems = task.problems(n_problems, seed=seed, split="test")
    device = next(model.parameters()).device  # everything on the model's device
    gen = torch.Generator(device).manual_seed(10_000 + seed)
    correct, answers, greedy = [], [], []
    for start in range(0, len(problems), batch_prompts):
        batch = problems[start:start + batch_prompts]
        ids, attn = encode_prompts(tokenizer, [p.prompt for p in batch], chat=chat, device=device)
        g = sample(model, tokenizer, ids, attn, max_new_tokens=max_new_tokens, greedy=True)
        greedy += [task.reward(p, t) for p, t in zip(batch, g.texts)]
        r = sample(model, tokenizer, ids, attn, repeats=k, max_new_tokens=max_new_tokens, temperature=temperature,
                   generator=gen)
        for i, p in enumerate(batch):
            texts = r.texts[i * k:(i + 1) * k]
            correct.append([task.reward(p, t) for t in texts])
            answers.append([task.extract(t) for t in texts])

    def summarise(rows: list[int]) -> dict:
        if not rows:
            return {}
        means = problem_means(problem_values([correct[i] for i in rows], [answers[i] for i in rows], k))
        # avg_at_{k} / pass_at_{k}: the older names, still written for the scripts that read them (deprecated)
        return {"n_problems": len(rows), **means, f"avg_at_{k}": means["avg_at_k"],
                f"pass_at_{k}": means["pass_at_k"], "greedy_accuracy": sum(greedy[i] for i in rows) / len(rows)}

    out = {"k": k, "temperature": temperature, **summarise(list(range(len(problems))))}
    if per_problem:
        out["per_problem"] = [sum(row) / len(row) for row in correct]
    hard = [i for i, p in enumerate(problems) if p.hard]
    if hard:
        out["hard"] = summarise(hard)
        out["easy"] = summarise([i for i, p in enumerate(problems) if not p.hard])
    return out
