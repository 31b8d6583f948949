"""The seeds of a seeded run (the ``seeded_rollouts`` setting), as pure functions: no OpenRLHF, vLLM or torch import,
so that the trainer actor (``rollouts``), the vLLM engine actor (``engine``) and the policy actor (``step``) read the
same rules.

- ``group_seed(seed, step, draw)``: the seed of the group of the prompt drawn ``draw``-th in step ``step``'s prompt
  stream, and ``sample_seed(group, i)`` its sample i's (``rollouts``, ``engine``);
- ``order_seed(seed, rank, step)``: what the policy actor seeds torch's generators with before OpenRLHF's
  ``ppo_train`` of step ``step`` draws the order of its micro-batches (``step.StareStep.ppo_train``).

Each is the first 62 bits of SHA-256 of a text naming what it seeds, so that no two coincide by arithmetic and
``group_seed + i`` stays a non-negative 63-bit integer, which every torch generator takes.
"""
from __future__ import annotations

import hashlib
import os

from .argv import SEED_ENV, SEEDED_ROLLOUTS_ENV

TRAIN, EVAL = "train", "eval"  # the seed streams of the training rollouts and of the in-training evaluation


def seeded_rollouts_on(environ=None) -> bool:
    """The ``seeded_rollouts`` setting as the workers get it (``STARE_SEEDED_ROLLOUTS``: 1 or 0; unset: on, the
    setting's default)."""
    environ = os.environ if environ is None else environ
    value = environ.get(SEEDED_ROLLOUTS_ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true", ""):
        raise RuntimeError(f"{SEEDED_ROLLOUTS_ENV}={environ[SEEDED_ROLLOUTS_ENV]!r}: expected 0 or 1")
    return value not in ("0", "false")


def run_seed(args, environ=None) -> int:
    """The run's seed: ``STARE_SEED`` (the ``seed`` setting), else OpenRLHF's ``--train.seed`` (the same value
    whenever ``stare train`` launched the run; 0 for parsed arguments without one)."""
    environ = os.environ if environ is None else environ
    seed = environ.get(SEED_ENV)
    return int(seed) if seed else int(getattr(getattr(args, "train", None), "seed", 0) or 0)


def _sha62(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 2


def group_seed(seed: int, step: int, draw: int, stream: str = TRAIN) -> int:
    """The seed of a prompt's group: from ``stare-rollout/<stream>/<seed>/<step>/<draw>``."""
    return _sha62(f"stare-rollout/{stream}/{seed}/{step}/{draw}")


def sample_seed(group: int, sample: int) -> int:
    """The seed of sample ``sample`` (0, 1, ...) of the group whose seed is ``group``: ``group + sample``, vLLM's own
    rule for the n samples of one request with ``n=n, seed=group`` (scripts/vllm_cpu_probe.py records it)."""
    return group + sample


def order_seed(seed: int, rank: int, step: int) -> int:
    """The seed of step ``step``'s update order on data-parallel rank ``rank``: from
    ``stare-update-order/<seed>/<rank>/<step>``."""
    return _sha62(f"stare-update-order/{seed}/{rank}/{step}")
