"""STARE's loss: OpenRLHF's ``PolicyLoss`` with a weight per token and, for KL-Cov, a penalty per token.

The weight is applied by scaling the advantage. Every term of OpenRLHF's per-token loss (-min(r A, clip(r) A), the
dual-clip bound c A, the IS-correction factor) is positively homogeneous in the advantage A, so the loss of A * w is
exactly w times the loss of A for w > 0, with the same clip statistics: no re-implementation of OpenRLHF's loss.
Clip-Cov's and 80-20's 0/1 masks are weights too (A * 0 gives a token loss of 0 in every branch, and the token stays
in OpenRLHF's denominators, as in the local engine's ``policy_loss``). Weights of None (gate off, or a baseline)
call OpenRLHF's loss unchanged.

KL-Cov is OpenRLHF's loss with every clip branch inactive plus ``c * |logp - old_logp|``, aggregated by OpenRLHF's
own ``aggregate_loss`` with the same arguments; the IS-correction factor, when on, multiplies OpenRLHF's term only.
"""
from __future__ import annotations

import inspect
import math

import torch

from .compat import PolicyLoss, aggregate_loss


class StarePolicyLoss(PolicyLoss):
    """OpenRLHF's ``PolicyLoss`` with a per-token weight (``token_weights``) and a per-token KL coefficient
    (``token_penalty``, KL-Cov), both set per micro-batch."""

    token_weights: torch.Tensor | None = None
    token_penalty: torch.Tensor | None = None

    @classmethod
    def from_parsed(cls, loss: PolicyLoss, *, unclipped: bool = False) -> "StarePolicyLoss":
        """The same loss with every setting OpenRLHF parsed (a copy of its attributes).

        ``unclipped`` (KL-Cov): OpenRLHF's own loss with every clip branch inactive: clip range (-inf, inf), so
        ``ratio.clamp`` is the identity and ``-min(r A, clamp(r) A)`` is ``-r A`` (the clip ratio it reports is
        0), and no dual clip. The log-ratio's +-20 clamp (a numerical guard, not a clip) stays."""
        new = cls.__new__(cls)
        new.__dict__.update(loss.__dict__)
        new.token_weights = None
        new.token_penalty = None
        if unclipped:
            new.clip_eps_low = new.clip_eps_high = math.inf
            new.dual_clip = None
        return new

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, *args, **kwargs):
        w = self.token_weights
        if w is not None:
            if w.shape != advantages.shape:
                raise ValueError(f"STARE weights {tuple(w.shape)} do not match the advantages {tuple(advantages.shape)}")
            # w >= 0 holds by construction (W, M and damp are validated > 0; the baselines' masks are 0/1); no host
            # read here, the loss runs once per micro-batch and must not synchronise
            advantages = advantages * w.to(device=advantages.device, dtype=advantages.dtype)
        out = super().forward(log_probs, old_log_probs, advantages, action_mask, *args, **kwargs)
        c = self.token_penalty
        if c is None:
            return out
        if c.shape != log_probs.shape:
            raise ValueError(f"KL-Cov coefficients {tuple(c.shape)} do not match the log-probs "
                             f"{tuple(log_probs.shape)}")
        # KL-Cov's term c * |log p - log p_old|, aggregated by OpenRLHF's own aggregate_loss with the arguments
        # its loss got (token- or sequence-level, global counts, dp_size): aggregation is linear in the
        # per-token loss, so this is the aggregate of (OpenRLHF's per-token loss + the term)
        call = _LOSS_SIGNATURE.bind(self, log_probs, old_log_probs, advantages, action_mask, *args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        term = c.to(device=log_probs.device, dtype=log_probs.dtype) * (log_probs - old_log_probs).abs()
        penalty = aggregate_loss(term, action_mask, token_level_loss=self.token_level_loss, dp_size=a["dp_size"],
                                 batch_num_tokens=a["batch_num_tokens"], global_batch_size=a["global_batch_size"])
        return (out[0] + penalty, *out[1:])


_LOSS_SIGNATURE = inspect.signature(PolicyLoss.forward)
