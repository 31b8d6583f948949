"""The reward OpenRLHF loads through ``--reward.remote_url <this file>``: 1 if the response's last ``\\boxed{}``
answer equals the label (math-verify, the same checker as ``stare eval``), else 0.

OpenRLHF 0.11.2 calls ``reward_func(queries, prompts, labels)`` from a thread of its rollout actor, with
``queries`` the decoded prompt + response. This function never raises into the rollout: any failure scores 0
and is counted in ``extra_logs`` (logged as ``train/stare/reward_*``). Each check is bounded in time
(``STARE_REWARD_TIMEOUT_S``, default 5 s) by ``stare.eval.scoring``'s worker-process pool, so a pathological
answer costs only itself.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from stare.eval.scoring import extract_boxed, score_many

logger = logging.getLogger("stare.reward")
TIMEOUT_ENV = "STARE_REWARD_TIMEOUT_S"


def _response_part(query: str, prompt: str) -> str:
    """The response: what follows the prompt in the query (a prompt's own ``\\boxed{}`` never counts)."""
    if prompt:
        at = query.find(prompt)
        if at >= 0:
            return query[at + len(prompt):]
    return query


def _timeout() -> float:
    try:
        value = float(os.environ.get(TIMEOUT_ENV, "5"))
    except ValueError:
        return 5.0
    return value if value > 0 else 5.0


def reward_func(queries, prompts, labels, **kwargs):
    n = len(queries)
    rewards = [0.0] * n
    no_answer = errors = timeouts = 0
    limit = _timeout()
    try:
        responses = [_response_part(q, p) for q, p in zip(queries, prompts)]
        no_answer = sum(extract_boxed(r) is None for r in responses)
        started = time.monotonic()
        verdicts = score_many(list(zip(responses, labels)), timeout=limit)
        elapsed = time.monotonic() - started
        rewards = [1.0 if v else 0.0 for v in verdicts]
        if elapsed >= limit and not any(verdicts):
            timeouts = n  # scored 0 because a check ran out of time (counted, not raised)
    except Exception:  # noqa: BLE001 - the rollout must never see an exception from the reward
        logger.exception("reward failed; scoring the batch 0")
        errors = n
        rewards = [0.0] * n
    t = torch.tensor(rewards, dtype=torch.float32)
    extra = {
        "stare/reward_no_answer": torch.tensor([float(no_answer) / max(n, 1)]),
        "stare/reward_error": torch.tensor([float(errors) / max(n, 1)]),
        "stare/reward_timeout": torch.tensor([float(timeouts) / max(n, 1)]),
    }
    return {"rewards": t, "scores": t, "extra_logs": extra}
