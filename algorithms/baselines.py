"""The token rules of the entropy baselines: Clip-Cov, KL-Cov, 80/20, entropy-adv and the Delightful Policy Gradient
gate (section 7 of docs/algorithm.md).

Each rule is a function of the old policy's per-token numbers over the whole step's batch, computed once per
step (``stare_step`` calls it), exact across data-parallel ranks when given a torch.distributed ``group``:

- ``token_covariance``: cov_t = (A_t - mean A) (logp_t - mean logp), both means over the step's response tokens.
- ``clip_cov_weights`` (Clip-Cov): 0 on a uniformly random ``max(1, floor(clip_ratio N))`` of the tokens whose
  covariance lies strictly inside (``cov_low``, ``cov_high``), 1 elsewhere; the loss multiplies it in as a weight,
  so those tokens give no gradient.
- ``kl_cov_coefs`` (KL-Cov): ``kl_coef`` on the top ``max(1, floor(k_ratio N))`` tokens by covariance, 0 elsewhere;
  the loss adds ``c |logp - old_logp|`` per token to the unclipped surrogate (``policy_loss(penalty=, clip=False)``).
- ``entropy_top_weights`` (80/20): 1 on the top ``ceil(top_ratio N)`` tokens by the old policy's entropy, 0 on the
  other response tokens, so the policy gradient flows through the high-entropy minority only.
- ``entropy_advantage_weights`` (entropy-adv, Cheng et al. 2025): each token's advantage becomes
  ``A + min(alpha H, |A| / kappa)``, H the old policy's entropy there (no gradient through it), as the weight
  ``(A + psi) / A = 1 + sign(A) min(alpha H / |A|, 1 / kappa)`` on its loss; ``kappa > 1`` keeps every sign, and an
  ``A = 0`` token stays 0 (weight 1). A per-token function: the step's other tokens do not enter.
- ``delight_gate_weights`` (dg, Osband 2026, Delightful Policy Gradient): each token's loss times
  ``sigmoid(A (-logp) / eta)``, the sigmoid of its "delight" (advantage times surprisal, the old policy's log-prob,
  no gradient through it): a surprising token with A > 0 keeps nearly all of its gradient, a surprising token with
  A < 0 nearly none, an expected token about half. Per token, like entropy-adv.
- ``steer_weights`` (steer, Hao et al. 2025, Rethinking Entropy Interventions in RLVR): each token's estimated
  entropy change ``Omega = A (1 - p) (log p + H)`` (p the old policy's probability of the sampled token, H its
  entropy there; the public code's ``(A / p_old) p (1 - p) (log p + H)`` at p = p_old), and a weight that falls as
  ``|Omega|`` grows: ``exp(-k |Omega|)`` clamped to [w_min, 1] with ``k = -ln(w_min) / max(max |Omega|, 0.02)`` (the
  largest change gets w_min), or a linear map of ``|Omega|`` from [min, max] onto [w_max, w_min]. The min and max
  are over the step's whole batch (all ranks); the public code takes them over each GPU's micro-batch.

N is the number of response tokens of the whole step (all ranks). Where the public implementation (verl's
``compute_policy_loss_clip_cov`` / ``compute_policy_loss_kl_cov``) differs, it is in scope and timing: verl
recomputes the covariance inside every micro-batch of every update, from the log-probs being trained (so the
selection depends on how the batch is split and drifts as the policy moves); here it is computed once, from the
old policy's log-probs, over the step's whole batch. At that point the ratio is 1 for every token, so Clip-Cov's
"not already clipped by PPO" condition excludes nothing; and if a selected token is clipped later in the step,
its clipped surrogate has no gradient anyway, so dropping it changes nothing.

Host reads: each rule reads its token counts once (one small synchronisation per step, never per micro-batch)
plus ``kth_largest``'s own reads; the covariance's means stay on the device. Pure torch; ``torch.distributed``
only when a ``group`` is given.
"""
from __future__ import annotations

import hashlib
import math

import torch

from ._checks import broadcast_advantages, check_choice, check_finite, check_range, check_same_shape
from ._plain import MASK_DENOMINATORS, STEER_MAPPINGS
from .selection import kth_largest, top_count


def floor_count(ratio: float, n: int) -> int:
    """max(1, floor(ratio * n)), at most n; 0 when n is 0. The product is rounded to 9 decimals first, so that
    a share that is a whole number of tokens (2e-3 * 5000) is not floored one below by float error."""
    if n <= 0:
        return 0
    return min(n, max(1, math.floor(round(ratio * n, 9))))


def clip_cov_seed(*parts: int) -> int:
    """A seed for Clip-Cov's random keys from the run's numbers (the run seed; the OpenRLHF plugin adds the rank and
    the step): a hash of them, so the stream is unrelated to any generator seeded with the numbers themselves and
    streams of neighbouring ranks and steps are unrelated to each other."""
    text = "stare-clip-cov:" + ":".join(str(int(p)) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & (2**63 - 1)


def _all_reduce(t: torch.Tensor, group, op: str = "SUM") -> torch.Tensor:
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
    return t


def _check_tokens(name: str, values: torch.Tensor, mask: torch.Tensor, **others) -> None:
    if values.dim() != 2:
        raise ValueError(f"{name} must be shaped [B, T], got shape {tuple(values.shape)}")
    check_same_shape(name, values, mask=mask, **others)


def _covariance(logprobs, advantages, mask, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(cov [B, T] float32, 0 on padding; the response-token count over all ranks, a float64 0-dim tensor)."""
    _check_tokens("logprobs", logprobs, mask)
    adv = broadcast_advantages(advantages, logprobs)
    valid = mask.bool()
    check_finite(valid, logprobs=logprobs)
    check_finite(None if adv.stride(-1) == 0 else valid, advantages=adv[:, :1] if adv.stride(-1) == 0 else adv)
    # float64 on the device: the sums of float32 values are then (nearly always) exact, so R ranks get the
    # same means as one process holding all their tokens
    lp = torch.where(valid, logprobs.detach().to(torch.float64), 0.0)
    a = torch.where(valid, adv.detach().to(torch.float64), 0.0)
    sums = _all_reduce(torch.stack([a.sum(), lp.sum(), valid.sum().to(torch.float64)]), group)
    n = sums[2]
    denom = n.clamp(min=1.0)
    cov = (a - sums[0] / denom) * (lp - sums[1] / denom)
    return torch.where(valid, cov, 0.0).to(torch.float32), n


def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                     group=None) -> torch.Tensor:
    """Per-token centred covariance of log-prob and advantage, ``[B, T]`` float32 (0 on padding).

    cov_t = (A_t - mean A) (logp_t - mean logp), each mean over the masked tokens of everything passed in, and
    over every rank of ``group`` when given (so a rank's covariances are those of the whole step's batch).
    ``logprobs``: ``[B, T]`` (detached; the old policy's, for the step's batch); ``advantages``: ``[B, T]`` or
    per-sequence ``[B]``; ``mask``: 1 / True on response tokens. No host read (the means stay on the device).
    """
    return _covariance(logprobs, advantages, mask, group)[0]


def clip_cov_weights(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    generator: torch.Generator | None = None,
    group=None,
    keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Clip-Cov's token mask, ``[B, T]`` float32: 0 on the tokens whose gradient is dropped, 1 elsewhere (padding 1).

    Candidates: response tokens with ``cov_low < cov < cov_high`` (``token_covariance``). The count is
    ``min(#candidates, max(1, floor(clip_ratio * N)))``, N the response tokens over all ranks; that many candidates
    are chosen uniformly at random: each gets a random key (``torch.rand`` from ``generator``, or the global
    generator when None; ``keys`` ``[B, T]`` overrides them, for tests), and the candidates with the largest keys
    over all ranks are chosen, exactly (the threshold by ``kth_largest``; keys tied at it are taken in rank, then
    row-major order, so the count is exact). With a ``group`` give each rank its own generator stream (for example
    seeded with seed + rank): identical streams give correlated keys on the ranks.
    """
    check_range("clip_ratio", clip_ratio, 0, 1, low_open=True)
    check_range("cov_low", cov_low, None, None)
    check_range("cov_high", cov_high, cov_low, None, low_open=True)
    if keys is not None:
        _check_tokens("logprobs", logprobs, mask, keys=keys)
    cov, n = _covariance(logprobs, advantages, mask, group)
    valid = mask.bool()
    cand = valid & (cov > cov_low) & (cov < cov_high)
    n_cand = _all_reduce(cand.sum().to(torch.float64), group)
    n_tokens, n_cand = (int(v) for v in torch.stack([n, n_cand]).tolist())  # the one host read of the counts
    weights = torch.ones(logprobs.shape, dtype=torch.float32, device=logprobs.device)
    k = min(n_cand, floor_count(clip_ratio, n_tokens))
    if k == 0:
        return weights
    if keys is None:
        device = generator.device if generator is not None else logprobs.device
        keys = torch.rand(logprobs.shape, generator=generator, device=device, dtype=torch.float32)
    keys = keys.to(device=logprobs.device, dtype=torch.float32)
    threshold = kth_largest(keys[cand], k, group)
    above = cand & (keys > threshold)
    tied = cand & (keys == threshold)
    # the tied keys fill what is left of the k, in (rank, row-major) order; all on the device
    if group is None:
        n_above = above.sum()
        before = torch.zeros((), dtype=torch.int64, device=keys.device)
    else:
        import torch.distributed as dist

        world, rank = dist.get_world_size(group), dist.get_rank(group)
        counts = torch.zeros(world + 1, dtype=torch.int64, device=keys.device)
        counts[0] = above.sum()
        counts[1 + rank] = tied.sum()
        _all_reduce(counts, group)
        n_above, before = counts[0], counts[1:1 + rank].sum()
    quota = (k - n_above - before).clamp(min=0)
    order = tied.reshape(-1).cumsum(0).reshape(tied.shape)  # 1, 2, ... over this rank's tied keys
    chosen = above | (tied & (order <= quota))
    return weights.masked_fill_(chosen, 0.0)


def kl_cov_coefs(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    k_ratio: float = 2e-3,
    kl_coef: float = 1.0,
    group=None,
) -> torch.Tensor:
    """KL-Cov's per-token penalty coefficients, ``[B, T]`` float32: ``kl_coef`` on the selected tokens, 0 elsewhere
    (and on padding).

    Selected: the response tokens whose covariance (``token_covariance``) is at or above the k-th largest over all
    ranks, k = ``max(1, floor(k_ratio * N))`` (at most N). A threshold, like STARE's top-k: tokens tied at it are
    all selected, so the choice never depends on order or layout.
    """
    check_range("k_ratio", k_ratio, 0, 1, low_open=True)
    check_range("kl_coef", kl_coef, 0, None)
    cov, n = _covariance(logprobs, advantages, mask, group)
    valid = mask.bool()
    coefs = torch.zeros(logprobs.shape, dtype=torch.float32, device=logprobs.device)
    k = floor_count(k_ratio, int(n))
    if k == 0:
        return coefs
    threshold = kth_largest(cov[valid], k, group)
    return coefs.masked_fill_(valid & (cov >= threshold), kl_coef)


def entropy_top_weights(entropy: torch.Tensor, mask: torch.Tensor, *, top_ratio: float = 0.2,
                        group=None, denominator: str = "all") -> torch.Tensor:
    """80/20's token weights, ``[B, T]`` float32: on the top ``ceil(top_ratio * N)`` response tokens by entropy
    the keep weight, 0 on the other response tokens, 1 on padding.

    ``entropy``: ``[B, T]``, the old policy's per-position entropy. The count is ``top_count`` (ceil, at least 1;
    0 when ``top_ratio`` is 0) over all ranks' N response tokens; a threshold, so tokens tied at it are all kept.
    ``denominator``: ``all`` keeps weight 1 (the loss stays divided by all N response tokens, as TRL's
    ``top_entropy_quantile``); ``selected`` gives the kept tokens N / S (S of them kept over all ranks), so a
    token-mean loss over the N tokens is the mean over the S selected ones, as the 80/20 paper's code divides it.
    """
    _check_tokens("entropy", entropy, mask)
    check_range("top_ratio", top_ratio, 0, 1)
    check_choice("denominator", denominator, MASK_DENOMINATORS)
    valid = mask.bool()
    check_finite(valid, entropy=entropy)
    values = entropy.detach().to(torch.float32)
    n = int(_all_reduce(valid.sum().to(torch.int64), group))  # the one host read of the count
    k = top_count(top_ratio, n)
    if k == 0:  # no response token anywhere, or top_ratio 0: nothing kept
        return torch.where(valid, 0.0, 1.0).to(torch.float32)
    threshold = kth_largest(values[valid], k, group)
    dropped = valid & (values < threshold)
    if denominator == "all":
        return torch.where(dropped, 0.0, 1.0).to(torch.float32)
    kept = int(_all_reduce((valid & ~dropped).sum().to(torch.int64), group))  # S >= k (ties at the threshold)
    keep = torch.where(valid, n / kept, 1.0).to(torch.float32)
    return torch.where(dropped, 0.0, keep)


def entropy_advantage_weights(advantages: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, *,
                              alpha: float = 0.4, kappa: float = 2.0) -> torch.Tensor:
    """entropy-adv's token weights, ``[B, T]`` float32: ``1 + sign(A) min(alpha H / |A|, 1 / kappa)`` on the
    response tokens with A != 0, 1 elsewhere, so that ``weight * A = A + min(alpha H, |A| / kappa)``.

    ``advantages``: ``[B, T]`` or per-sequence ``[B]``; ``entropy``: ``[B, T]``, the old policy's per-position
    entropy (detached); ``alpha > 0``, ``kappa > 1``.
    """
    _check_tokens("entropy", entropy, mask)
    check_range("alpha", alpha, 0, None, low_open=True)
    check_range("kappa", kappa, 1, None, low_open=True)
    adv = broadcast_advantages(advantages, entropy).to(torch.float32)
    valid = mask.bool() & (adv != 0)
    check_finite(mask.bool(), entropy=entropy, advantages=adv)
    h = entropy.detach().to(torch.float32)
    size = adv.abs()
    term = torch.minimum(alpha * h / torch.where(valid, size, 1.0), torch.full_like(size, 1.0 / kappa))
    return torch.where(valid, 1.0 + torch.sign(adv) * term, 1.0).to(torch.float32)


def entropy_advantage_sums(advantages: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, *,
                           alpha: float = 0.4, kappa: float = 2.0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """entropy-adv's telemetry as (numerator, denominator) pairs over this rank's tokens: ``shaped_share`` (of the
    response tokens with A != 0, those whose advantage the term changed: H > 0) and ``shaping_clipped_share`` (of
    those, the ones held at the bound |A| / kappa)."""
    adv = broadcast_advantages(advantages, entropy).to(torch.float32)
    nonzero = mask.bool() & (adv != 0)
    h = entropy.detach().to(torch.float32)
    shaped = nonzero & (h > 0)
    clipped = shaped & (alpha * h >= adv.abs() / kappa)
    return {"shaped_share": (shaped.sum(), nonzero.sum()), "shaping_clipped_share": (clipped.sum(), shaped.sum())}


def delight_gate_weights(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                         eta: float = 1.0) -> torch.Tensor:
    """The Delightful Policy Gradient gate as token weights, ``[B, T]`` float32: ``sigmoid(A (-logp) / eta)`` on the
    response tokens (a token with A = 0 gets sigmoid(0) = 1/2, which multiplies a zero loss), 1 on padding.

    ``logprobs``: ``[B, T]``, the log-prob of each sampled token under the policy that sampled it (detached here);
    ``advantages``: ``[B, T]`` or per-sequence ``[B]``; ``eta > 0`` the gate's temperature (the paper's 1).
    """
    _check_tokens("logprobs", logprobs, mask)
    check_range("eta", eta, 0, None, low_open=True)
    adv = broadcast_advantages(advantages, logprobs).to(torch.float32)
    valid = mask.bool()
    check_finite(valid, logprobs=logprobs, advantages=adv)
    delight = torch.where(valid, adv * -logprobs.detach().to(torch.float32), 0.0)
    return torch.where(valid, torch.sigmoid(delight / eta), 1.0).to(torch.float32)


DG_NEAR = 0.1  # the gate's telemetry counts a gate below DG_NEAR as near 0 and one above 1 - DG_NEAR as near 1


def delight_gate_sums(gate: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """dg's telemetry from its ``gate`` (``delight_gate_weights``) as (numerator, denominator) pairs over this rank's
    response tokens with A != 0 (the tokens the gate acts on): ``gate_mean``, ``gate_low_share`` (gate < DG_NEAR:
    nearly no gradient) and ``gate_high_share`` (gate > 1 - DG_NEAR: nearly all of it)."""
    adv = broadcast_advantages(advantages, gate)
    acted = mask.bool() & (adv != 0)
    n = acted.sum()
    return {"gate_mean": (torch.where(acted, gate, 0.0).sum(), n),
            "gate_low_share": ((acted & (gate < DG_NEAR)).sum(), n),
            "gate_high_share": ((acted & (gate > 1 - DG_NEAR)).sum(), n)}


STEER_MAX_FLOOR = 0.02  # the exp mapping's scale never reads a max |Omega| below this (the public code's floor)


def steer_change(logprobs: torch.Tensor, advantages: torch.Tensor, entropy: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """STEER's estimated entropy change per token, ``Omega = A (1 - p) (log p + H)``, ``[B, T]`` float32, 0 on padding
    (and where it is not finite, as the public code sets it); p = exp(logprobs) clamped to [1e-8, 1 - 1e-8]."""
    _check_tokens("logprobs", logprobs, mask, entropy=entropy)
    adv = broadcast_advantages(advantages, logprobs).to(torch.float32)
    valid = mask.bool()
    check_finite(valid, logprobs=logprobs, advantages=adv, entropy=entropy)
    logp = torch.where(valid, logprobs.detach().to(torch.float32), 0.0)
    p = torch.exp(logp).clamp(1e-8, 1 - 1e-8)
    omega = adv * (1 - p) * (torch.log(p) + entropy.detach().to(torch.float32))
    return torch.where(valid & torch.isfinite(omega), omega, 0.0)


def steer_weights(logprobs: torch.Tensor, advantages: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor, *,
                  mapping: str = "exp", weight_min: float = 0.8, weight_max: float = 1.2,
                  group=None) -> torch.Tensor:
    """STEER's token weights, ``[B, T]`` float32 (1 on padding), from ``m = |steer_change(...)|`` over the step's
    response tokens (all ranks of ``group``):

    - ``exp``: ``clamp(exp(-k m), weight_min, 1)``, ``k = -ln(weight_min) / max(max m, 0.02)``; ``weight_max`` unused
      (the public code caps this mapping at 1);
    - ``linear``: ``weight_max - (m - min m) (weight_max - weight_min) / (max m - min m)`` clamped to
      [weight_min, weight_max]; every token ``(weight_min + weight_max) / 2`` when max m == min m.
    """
    check_choice("mapping", mapping, STEER_MAPPINGS)
    if mapping == "exp":
        check_range("weight_min", weight_min, 0, 1, low_open=True, high_open=True)
    else:
        check_range("weight_min", weight_min, 0, None, low_open=True)
        if not weight_max > weight_min:
            raise ValueError(f"weight_max {weight_max!r} must be > weight_min {weight_min!r} for the linear mapping")
    valid = mask.bool()
    m = steer_change(logprobs, advantages, entropy, mask).abs()
    top = _all_reduce(torch.where(valid, m, 0.0).amax().reshape(1), group, "MAX")[0]  # m >= 0: 0 for no token
    if mapping == "exp":
        k = -math.log(weight_min) / top.clamp(min=STEER_MAX_FLOOR)
        w = torch.exp(-k * m).clamp(weight_min, 1.0)
    else:
        low = -_all_reduce(torch.where(valid, -m, -math.inf).amax().reshape(1), group, "MAX")[0]
        span = top - low
        w = weight_max - (m - low) * (weight_max - weight_min) / torch.where(span > 0, span, 1.0)
        w = torch.where(span > 0, w.clamp(weight_min, weight_max), torch.full_like(w, (weight_min + weight_max) / 2))
    return torch.where(valid, w, 1.0).to(torch.float32)


def steer_sums(logprobs: torch.Tensor, advantages: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor,
               weights: torch.Tensor, *, weight_min: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """steer's telemetry as (numerator, denominator) pairs over this rank's response tokens: ``steer_floor_share``
    (tokens at the weight floor, the largest estimated changes) and ``steer_raise_share`` (of the tokens with
    Omega != 0, those whose update the estimate says raises entropy: Omega < 0, as the paper's sign has it)."""
    valid = mask.bool()
    omega = steer_change(logprobs, advantages, entropy, mask)
    moving = valid & (omega != 0)
    return {"steer_floor_share": ((valid & (weights <= weight_min * (1 + 1e-6))).sum(), valid.sum()),
            "steer_raise_share": ((moving & (omega < 0)).sum(), moving.sum())}
