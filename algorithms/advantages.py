"""Group-relative advantages and the reward-side pieces of DAPO (dynamic sampling, overlong shaping).

Pure functions on tensors. Rewards are laid out ``[num_prompts, G]``: row i holds the G sampled responses
of prompt i.
"""
from __future__ import annotations

import torch

from ._checks import check_finite, check_range


def group_advantages(rewards: torch.Tensor, *, std_norm: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std + ``eps``.

    ``std_norm=False`` skips the division (Dr.GRPO). The std is the unbiased sample std, as in verl and
    OpenRLHF. A group whose rewards are all equal (including a group of one) gets exactly 0, not a value
    rounded near 0, so those responses carry no gradient.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be shaped [num_prompts, G], got shape {tuple(rewards.shape)}")
    check_range("eps", eps, 0, None)
    rewards = rewards.to(torch.float32) if not rewards.is_floating_point() else rewards
    check_finite(rewards=rewards)
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if std_norm and rewards.shape[-1] > 1:
        centred = centred / (rewards.std(dim=-1, keepdim=True) + eps)
    flat = rewards.amax(dim=-1, keepdim=True) == rewards.amin(dim=-1, keepdim=True)
    return torch.where(flat, torch.zeros_like(centred), centred)


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Bool [num_prompts]: groups whose rewards are not all equal (DAPO dynamic sampling keeps these)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be shaped [num_prompts, G], got shape {tuple(rewards.shape)}")
    return rewards.amax(dim=-1) != rewards.amin(dim=-1)


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward.

    0 up to ``max_len - buffer_len`` tokens, then falling linearly to ``-factor`` at ``max_len``, and
    ``-factor`` beyond it.
    """
    check_range("max_len", max_len, 0, None, low_open=True)
    check_range("buffer_len", buffer_len, 0, max_len)
    check_range("factor", factor, 0, None)
    lengths = lengths.to(torch.float64)
    if buffer_len == 0:
        return torch.where(lengths > max_len, -factor, 0.0).to(torch.float32)
    start = max_len - buffer_len
    ramp = (start - lengths) / buffer_len * factor
    return ramp.clamp(min=-factor, max=0.0).to(torch.float32)
