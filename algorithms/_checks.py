"""Argument checks shared by the algorithm functions.

Every check raises ``ValueError`` naming the parameter and what would have been valid. Shape checks read
only tensor metadata. The finiteness check reads tensor values, which on an accelerator is a host
synchronisation: callers on the per-micro-batch path only run it on CPU tensors (see ``should_validate``),
and the once-per-step functions (selection, controllers) run it always.
"""
from __future__ import annotations

import math

import torch

from ._plain import check_choice, check_range  # noqa: F401 - torch-free, re-exported here


def check_same_shape(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and tuple(t.shape) != tuple(ref.shape):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}; they must match"
            )


def broadcast_advantages(advantages: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantages [B] become per-token [B, T]; per-token advantages must match ``ref``."""
    if advantages.dim() == 1 and ref.dim() == 2 and advantages.shape[0] == ref.shape[0]:
        return advantages.unsqueeze(-1).expand_as(ref)
    check_same_shape("logprobs", ref, advantages=advantages)
    return advantages


def should_validate(validate: bool | None, *tensors: torch.Tensor) -> bool:
    """``None`` means: check values only where that costs no device synchronisation (CPU tensors)."""
    if validate is not None:
        return validate
    return all(t.device.type == "cpu" for t in tensors if t is not None)


def check_finite(where: torch.Tensor | None = None, **tensors: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming each tensor that holds NaN or inf, and how many such entries it has.

    With ``where`` (a mask broadcastable to the tensors), only those entries count: padding may hold anything.
    """
    for name, t in tensors.items():
        if t is None or not t.is_floating_point():
            continue
        if bool(torch.isfinite(t.detach().sum(dtype=torch.float32))):
            continue  # one reduction: a finite sum means every entry is finite
        nonfinite = ~torch.isfinite(t)
        if where is not None:
            nonfinite = nonfinite & where.bool()
        bad = int(nonfinite.sum())
        if bad:
            raise ValueError(f"{name} holds {bad} non-finite value(s) (NaN or inf) out of {t.numel()}; refusing to train on it")
