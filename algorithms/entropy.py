"""Entropy, surprisal and the first-order entropy sensitivity Phi, plus the statistics built on them.

For one position with next-token distribution p, surprisal s_j = -log p_j and entropy H = sum_j p_j s_j, a
policy-gradient step of size eta on the sampled token a with advantage A moves the logits by
eta A (e_a - p) and, to first order, the entropy by eta A Phi with

    Phi(p, a) = p_a (s_a - H) - sum_j p_j^2 (s_j - H)

(section 2 of docs/stare-algorithm.md). ``entropy_sensitivity`` computes H, s_a and Phi in one pass over
the logits, ``chunk_size`` rows at a time, in float32, without gradient: the extra memory is a few
chunk x V buffers, never N x V.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ._checks import broadcast_advantages, check_range, check_same_shape

# Default chunk: about 4M logits (16 MB per float32 buffer) whatever the vocabulary size.
DEFAULT_CHUNK_ELEMENTS = 1 << 22


class EntropyStats(NamedTuple):
    entropy: torch.Tensor  # H per position, float32
    surprisal: torch.Tensor  # s_a = -log p_a of the given action, float32
    phi: torch.Tensor  # first-order entropy sensitivity, float32


@torch.no_grad()
def entropy_sensitivity(
    logits: torch.Tensor,
    actions: torch.Tensor,
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> EntropyStats:
    """Per-position entropy, the action's surprisal and Phi for logits ``[..., V]`` and actions ``[...]``.

    ``temperature`` divides the logits first (the gate wants the entropy at the sampling temperature).
    ``chunk_size`` rows are processed at a time (default: about 4M logits per chunk).
    """
    if logits.dim() < 1 or tuple(actions.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"actions must have the logits' shape without the vocabulary dimension: logits {tuple(logits.shape)}, "
            f"actions {tuple(actions.shape)}"
        )
    if actions.is_floating_point():
        raise ValueError(f"actions must be integer token ids, got dtype {actions.dtype}")
    check_range("temperature", temperature, 0, None, low_open=True)
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_actions = actions.reshape(-1).to(torch.long)
    n = flat_logits.shape[0]
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_CHUNK_ELEMENTS // max(vocab, 1))
    check_range("chunk_size", chunk_size, 1, None)

    entropy = torch.empty(n, dtype=torch.float32, device=logits.device)
    surprisal = torch.empty_like(entropy)
    phi = torch.empty_like(entropy)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        z = flat_logits[start:end].to(torch.float32)
        if temperature != 1.0:
            z = z / temperature
        logp = torch.log_softmax(z, dim=-1)
        del z
        p = logp.exp()
        p_logp = p * logp
        h = -p_logp.sum(dim=-1)
        sum_p2 = torch.linalg.vecdot(p, p)
        sum_p2_logp = torch.linalg.vecdot(p, p_logp)
        del p_logp
        logp_a = logp.gather(-1, flat_actions[start:end, None]).squeeze(-1)
        del logp, p
        s_a = -logp_a
        # sum_j p_j^2 (s_j - H) = -sum_j p_j^2 log p_j - H sum_j p_j^2
        second = -sum_p2_logp - h * sum_p2
        entropy[start:end] = h
        surprisal[start:end] = s_a
        phi[start:end] = logp_a.exp() * (s_a - h) - second
    shape = actions.shape
    return EntropyStats(entropy.view(shape), surprisal.view(shape), phi.view(shape))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ``mask`` (0-dim tensor; 0 when the mask is empty)."""
    m = mask.to(torch.float32)
    return (values.to(torch.float32) * m).sum() / m.sum().clamp(min=1.0)


def entropy_forecast_sums(
    phi: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of w A Phi over the response tokens, number of response tokens)``, 0-dim float32 tensors.

    ``predicted_entropy_change`` is their quotient; summing both over data-parallel ranks before dividing gives
    the exact forecast over all ranks' tokens. ``phi`` and ``mask``: ``[B, T]``; ``advantages``: ``[B, T]`` or
    per-sequence ``[B]``; ``weights``: ``[B, T]`` or None (all 1).
    """
    advantages = broadcast_advantages(advantages, phi)
    check_same_shape("phi", phi, mask=mask, weights=weights)
    contrib = advantages.to(torch.float32) * phi.to(torch.float32)
    if weights is not None:
        contrib = contrib * weights.to(torch.float32)
    m = mask.to(torch.float32)
    return (contrib * m).sum(), m.sum()


def predicted_entropy_change(
    phi: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """First-order forecast of the change of the batch's mean token entropy, per unit step size.

    The token-mean of ``w A Phi`` over response tokens: each token's own logits move along its advantage
    (scaled by its STARE weight when given). It ignores clipping and the coupling between positions through
    shared parameters, so it forecasts direction and relative size, not the exact change.
    """
    total, n_tokens = entropy_forecast_sums(phi, advantages, mask, weights=weights)
    return total / n_tokens.clamp(min=1.0)


QUADRANTS = ("pos_low", "pos_high", "neg_low", "neg_high")


def quadrant_sums(
    surprisal: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    phi: torch.Tensor | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``quadrant_stats`` as (numerator, denominator) pairs of 0-dim float32 tensors, before the division.

    Summing numerators and denominators over data-parallel ranks before dividing gives the exact shares over all
    ranks' tokens (the denominators: tokens with A != 0 for the shares, response tokens for the contributions).
    """
    advantages = broadcast_advantages(advantages, surprisal)
    check_same_shape("surprisal", surprisal, entropy=entropy, mask=mask, phi=phi)
    m = mask.bool()
    high = surprisal > entropy
    cells = {
        "pos_low": m & (advantages > 0) & ~high,
        "pos_high": m & (advantages > 0) & high,
        "neg_low": m & (advantages < 0) & ~high,
        "neg_high": m & (advantages < 0) & high,
    }
    counts = {k: c.to(torch.float32).sum() for k, c in cells.items()}
    active = sum(counts.values())
    out = {f"{k}_share": (counts[k], active) for k in cells}
    if phi is not None:
        contrib = advantages.to(torch.float32) * phi.to(torch.float32)
        n_tokens = m.to(torch.float32).sum()
        for k, c in cells.items():
            out[f"{k}_contrib"] = ((contrib * c).sum(), n_tokens)
    return out


def quadrant_stats(
    surprisal: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    phi: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """How the step's tokens fall into the four advantage-sign x surprisal-vs-entropy quadrants.

    Quadrants: ``pos_low`` (A > 0, s <= H: lowers entropy, the usual majority), ``pos_high`` (A > 0, s > H:
    raises it), ``neg_low`` (A < 0, s <= H: raises it), ``neg_high`` (A < 0, s > H: lowers it). Returns
    ``{quadrant}_share`` (share of the response tokens with A != 0) and, with ``phi``, ``{quadrant}_contrib``:
    the quadrant's part of ``predicted_entropy_change`` (they add up to it). All values are 0-dim tensors.
    Shapes: ``surprisal``, ``entropy``, ``mask``, ``phi`` ``[B, T]``; ``advantages`` ``[B, T]`` or ``[B]``.
    """
    return {k: num / den.clamp(min=1.0)
            for k, (num, den) in quadrant_sums(surprisal, entropy, advantages, mask, phi=phi).items()}
