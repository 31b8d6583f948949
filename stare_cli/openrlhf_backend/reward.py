"""The reward OpenRLHF loads through ``--reward.remote_url <this file>``: 1 if the response's last ``\\boxed{}``
answer equals the label (math-verify, the same checker as ``stare eval``), else 0.

The pinned OpenRLHF calls ``reward_func(queries, prompts, labels)`` from a thread of its rollout actor, with
``queries`` the decoded prompt + response. This function never raises into the rollout: any failure scores 0
and is counted in ``extra_logs`` (logged as ``train/stare/reward_*``, each the fraction of the batch):
``reward_no_answer`` (no boxed answer), ``reward_timeout`` (a check ran out of time),
``reward_scoring_failed`` (the checker itself could not run: ``ScoringError``, e.g. its workers did not start;
these zeros are not wrong answers) and ``reward_error`` (anything else). Each check is bounded in time
(``STARE_REWARD_TIMEOUT_S``, default 5 s) by ``stare.eval.scoring``'s worker processes, so a pathological
answer costs only itself.
"""
from __future__ import annotations

import logging
import os
import torch

from stare.eval.extraction import extract_boxed
from stare.eval.scoring import ScoringError, check_many

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
    no_answer = errors = timeouts = failed = 0
    limit = _timeout()
    try:
        responses = [_response_part(q, p) for q, p in zip(queries, prompts)]
        no_answer = sum(extract_boxed(r) is None for r in responses)
        verdicts = check_many(list(zip(responses, labels)), timeout=limit)
        rewards = [1.0 if v == "correct" else 0.0 for v in verdicts]
        timeouts = sum(v == "timeout" for v in verdicts)
    except ScoringError as exc:  # the checker could not run: zeros that are not wrong answers
        logger.error("reward: the answer checker could not run (%s); scoring the batch 0", exc)
        failed = n
        rewards = [0.0] * n
    except Exception:  # noqa: BLE001 - the rollout must never see an exception from the reward
        logger.exception("reward failed; scoring the batch 0")
        errors = n
        rewards = [0.0] * n
    t = torch.tensor(rewards, dtype=torch.float32)
    extra = {
        "stare/reward_no_answer": torch.tensor([float(no_answer) / max(n, 1)]),
        "stare/reward_error": torch.tensor([float(errors) / max(n, 1)]),
        "stare/reward_timeout": torch.tensor([float(timeouts) / max(n, 1)]),
        "stare/reward_scoring_failed": torch.tensor([float(failed) / max(n, 1)]),
    }
    return {"rewards": t, "scores": t, "extra_logs": extra}
