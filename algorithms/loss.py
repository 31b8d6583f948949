"""The clipped policy-gradient surrogate with per-token weights and layout-independent aggregation.

One token's loss (section 2 of docs/algorithm.md):

    rho    = exp(clamp(logp - old_logp, -20, 20))
    loss_t = max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high))
    loss_t = min(loss_t, -A c)        for A < 0, with dual clip c > 1
    loss_t = weight_t * loss_t        STARE's token weights (1 where unset)
    loss_t = loss_t + c_t |logp - old_logp|   with ``penalty`` c (KL-Cov's coefficients; absent where unset)

An entropy bonus (``entropy_bonus_loss``) is a separate term on the current policy's entropy, aggregated the same
way; the engines add it to this loss.

``clip=False`` replaces the two clipped lines by the plain surrogate ``-A rho`` (no clip, no dual clip), as KL-Cov
uses it.

Aggregation divides by token or sequence counts. Give ``num_tokens`` / ``num_seqs`` as the counts of the
whole step (all micro-batches, all data-parallel ranks) and each micro-batch's loss becomes its share of the
step's loss: the shares add up to the full-batch loss, so gradient accumulation gives the one-big-batch
gradient. (A data-parallel wrapper that averages gradients over R ranks needs the loss multiplied by R.)

Nothing here reads a tensor's value on the host: the metrics come back as 0-dim tensors, and the finiteness
check only runs where it is free (CPU tensors) unless asked for.
"""
from __future__ import annotations

import torch

from ._checks import (
    broadcast_advantages,
    check_choice,
    check_finite,
    check_range,
    check_same_shape,
    should_validate,
)

from ._plain import AGGREGATIONS  # noqa: E402 - token-mean, seq-mean-token-mean, seq-mean-token-sum-norm
LOG_RATIO_CLAMP = 20.0


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    agg: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    norm_len: int | None = None,
    validate: bool | None = None,
    penalty: torch.Tensor | None = None,
    clip: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss over ``[B, T]`` token tensors; returns ``(loss, metrics)``.

    - ``advantages``: ``[B, T]`` or per-sequence ``[B]``.
    - ``mask``: 1 on response tokens, 0 on padding.
    - ``weights``: per-token multipliers of each token's loss (they do not enter the denominators).
    - ``agg``: ``token-mean`` (sum / num_tokens), ``seq-mean-token-mean`` (mean over sequences of each
      sequence's token mean), ``seq-mean-token-sum-norm`` (Dr.GRPO: sum / (num_seqs * norm_len)).
    - ``num_tokens`` / ``num_seqs``: global counts; default to this call's own counts (``mask.sum()`` and
      ``B``). ``norm_len`` (Dr.GRPO's constant) defaults to ``T``; pass the maximum response length so
      that it does not depend on padding.
    - ``validate``: check for NaN/inf; ``None`` checks CPU tensors only (no device synchronisation).
    - ``penalty``: ``[B, T]`` per-token coefficients c >= 0 (KL-Cov's ``kl_cov_coefs``); each token's loss gains
      ``c * |logp - old_logp|`` (not multiplied by ``weights``; the same aggregation). ``None``: no term.
    - ``clip``: ``False`` gives the unclipped surrogate ``-A rho`` for every token (no clip, no dual clip; the
      clip metrics are then 0). The defaults (``penalty=None, clip=True``) give exactly the loss without them.

    ``metrics``: ``clip_frac_low`` (A < 0 tokens held at 1 - clip_low), ``clip_frac_high`` (A > 0 tokens
    held at 1 + clip_high), ``dual_clip_frac``, ``approx_kl`` (k3 estimator of KL(old || new)) and
    ``weight_mean``; each a masked sum over the same token denominator as ``token-mean``, so with global
    counts the micro-batch values also add up to the step's.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be shaped [B, T], got shape {tuple(logprobs.shape)}")
    check_same_shape("logprobs", logprobs, old_logprobs=old_logprobs, mask=mask, weights=weights, penalty=penalty)
    advantages = broadcast_advantages(advantages, logprobs)
    check_choice("aggregation", agg, AGGREGATIONS)
    check_range("clip_low", clip_low, 0, 1)
    check_range("clip_high", clip_high, 0, None)
    if dual_clip is not None:
        check_range("dual_clip", dual_clip, 1, None, low_open=True)
    if norm_len is not None:
        check_range("norm_len", norm_len, 0, None, low_open=True)
    if should_validate(validate, logprobs, old_logprobs, advantages, weights, penalty):
        where = mask.bool()
        check_finite(where, logprobs=logprobs.detach(), old_logprobs=old_logprobs, advantages=advantages,
                     weights=weights, penalty=penalty)
        if penalty is not None and bool(((penalty < 0) & where).any()):
            raise ValueError("penalty holds negative coefficient(s); it must be >= 0 on the response tokens")

    valid = mask.bool()
    mask_f = mask.to(logprobs.dtype)
    # Padding may hold anything (even NaN): select, never multiply, so it cannot leak into loss or gradient.
    advantages = torch.where(valid, advantages.to(logprobs.dtype), 0.0)
    log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    neg = advantages < 0
    if not clip:
        token_loss = unclipped
    else:
        clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        token_loss = torch.maximum(unclipped, clipped)
    if clip and dual_clip is not None:
        cap = -advantages * dual_clip
        dual_hit = neg & (token_loss > cap)
        token_loss = torch.where(neg, torch.minimum(token_loss, cap), token_loss)
    else:
        dual_hit = torch.zeros_like(neg)
    # the weights ride on the mask: one multiply applies both (padding selected to 0, so NaN cannot leak)
    loss_mask = mask_f if weights is None else torch.where(valid, weights.to(token_loss.dtype), 0.0)
    masked_loss = token_loss * loss_mask
    if penalty is not None:  # c |logp - old_logp| (unclamped), padding selected to 0
        abs_diff = torch.where(valid, logprobs - old_logprobs, 0.0).abs()
        masked_loss = masked_loss + torch.where(valid, penalty.to(token_loss.dtype), 0.0) * abs_diff

    if num_tokens is None:
        num_tokens = mask_f.sum()
    loss = _aggregate(masked_loss, mask_f, agg, num_tokens, num_seqs, norm_len)

    with torch.no_grad():
        denom = num_tokens

        def frac(flags: torch.Tensor) -> torch.Tensor:
            return (flags.to(mask_f.dtype) * mask_f).sum() / denom

        r = ratio.detach()
        held = torch.ones_like(neg) if clip else torch.zeros_like(neg)  # clip=False: nothing is held
        metrics = {
            "clip_frac_low": frac(held & neg & (r < 1.0 - clip_low)),
            "clip_frac_high": frac(held & (advantages > 0) & (r > 1.0 + clip_high)),
            "dual_clip_frac": frac(dual_hit),
            "approx_kl": ((r - 1.0 - log_ratio.detach()) * mask_f).sum() / denom,
            "weight_mean": loss_mask.sum() / denom,
        }
    return loss, metrics


def _aggregate(masked: torch.Tensor, mask_f: torch.Tensor, agg: str, num_tokens, num_seqs, norm_len) -> torch.Tensor:
    """One number from per-token values already multiplied by the mask, as ``agg`` says (see ``policy_loss``)."""
    if num_tokens is None:
        num_tokens = mask_f.sum()
    if num_seqs is None:
        num_seqs = masked.shape[0]
    if agg == "token-mean":
        return masked.sum() / num_tokens
    if agg == "seq-mean-token-mean":
        seq_len = mask_f.sum(dim=-1).clamp(min=1.0)
        return (masked.sum(dim=-1) / seq_len).sum() / num_seqs
    length = masked.shape[-1] if norm_len is None else norm_len  # seq-mean-token-sum-norm
    return masked.sum() / (num_seqs * length)


def entropy_bonus_loss(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    *,
    agg: str = "token-mean",
    num_tokens: int | float | torch.Tensor | None = None,
    num_seqs: int | float | torch.Tensor | None = None,
    norm_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entropy bonus's part of the loss, ``(-coef * E, E)``: E the current policy's token ``entropy`` ``[B, T]``
    (with its gradient) over ``mask``, aggregated exactly as ``policy_loss`` aggregates the token losses with the
    same ``agg`` and counts (so with global counts the micro-batches' parts add up to the step's, as OpenRLHF's
    ``aggregate_loss`` does for its ``--actor.entropy_coef`` term). Add the first to the policy loss."""
    if entropy.dim() != 2:
        raise ValueError(f"entropy must be shaped [B, T], got shape {tuple(entropy.shape)}")
    check_same_shape("entropy", entropy, mask=mask)
    check_choice("aggregation", agg, AGGREGATIONS)
    check_range("coef", coef, 0, None)
    valid = mask.bool()
    mask_f = mask.to(entropy.dtype)
    term = _aggregate(torch.where(valid, entropy, 0.0), mask_f, agg, num_tokens, num_seqs, norm_len)
    return -coef * term, term
