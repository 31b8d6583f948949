"""STARE's token selection and weights.

The paper's rule (``selection="quantile"``), over the response tokens passed in (the whole step's batch):

    T+ = tokens with A > 0, T- = tokens with A < 0 (A = 0 is never reweighted)
    L+ = the ceil(P |T+|) tokens of T+ with the highest surprisal s = -logp (at least 1), L- likewise in T-
    O1: weight W on L+;  C2: also weight M on L-;  every other token keeps weight 1

"Top k" is a threshold: the k-th largest surprisal in the set, every token at or above it selected (exact
ties at the threshold are all selected, so the choice never depends on token order or layout).

The exact rule (``selection="phi"``, section 3 of docs/algorithm.md) selects by the sign of the
first-order entropy sensitivity instead: L+ = A > 0 and Phi > 0 (they raise entropy), L- = A < 0 and
Phi > 0 (they lower it), optionally capped to the top ``phi_cap`` share by Phi; ``damp`` weights the
entropy-lowering majority (A > 0, Phi < 0). ``direction=-1`` mirrors everything (the ranking key is
negated) for a two-sided controller that pushes entropy down.

``phi_tol`` (the exact rule) keeps a near-zero Phi from deciding by its sign: with y = |A| Phi and
tau = max(phi_tol * mean |y| over the step's A != 0 tokens, PHI_TOL_FLOOR), a token counts as entropy-raising
by r = clamp((y + tau) / (2 tau), 0, 1): weight damp + r (W - damp) for A > 0, 1 + r (M - 1) for A < 0 (C2).
Beyond +-tau this is the sign rule; at zero it is the mean of the two weights a coin flip of the sign would
pick. The weights are a continuous function of Phi, so numbers that differ in the last bits give weights that
differ in the last bits. ``phi_tol=0`` is the plain sign rule.

Selection is a once-per-step operation: it reads counts on the host to size the top-k, which is one small
synchronisation per step, not per micro-batch. With a torch.distributed ``group`` the thresholds are found
exactly over all ranks' tokens by a radix select on the float bit patterns (four all-reduces of a
256-bin histogram each), and each rank gets the weights of its own tokens.
"""
from __future__ import annotations

import math

import torch

from ._checks import broadcast_advantages, check_choice, check_finite, check_range, check_same_shape

from ._plain import SELECTIONS, VARIANTS  # noqa: E402 - ("quantile", "phi"), ("O1", "C2"); torch-free for the registry


# the smallest tau of the phi_tol rule, on the |A Phi| scale: the float32 error of a computed Phi is about 1e-7 times
# the logits' scale, so below this a sign is noise whatever the step's mean
PHI_TOL_FLOOR = 1e-6


def top_count(ratio: float, n: int) -> int:
    """ceil(ratio * n), at least 1 when ratio > 0 and n > 0; 0 when ratio is 0 (selection disabled).

    The product is rounded to 9 decimals first so that 0.1 * 30 gives 3, not 4.
    """
    if n <= 0 or ratio <= 0:
        return 0
    return min(n, max(1, math.ceil(round(ratio * n, 9))))


def _ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """Map float32 values to int64 keys in [0, 2^32) with the same order (for radix select)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    # Negative floats: flip all magnitude bits so more negative sorts lower; then shift to non-negative.
    keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return keys + (1 << 31)


def _key_to_float(key: int) -> float:
    bits = key - (1 << 31)
    if bits < 0:
        bits ^= 0x7FFFFFFF
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32).item()


def kth_largest(values: torch.Tensor, k: int, group=None) -> float:
    """The k-th largest of ``values`` (1-D, float), over all ranks of ``group`` when given (exact).

    ``k`` counts over the union of all ranks' values. Without a group this is one ``torch.kthvalue`` (no
    size limit, unlike ``torch.quantile``); with one, a radix select on the float32 bit patterns.
    """
    values = values.reshape(-1)
    if group is None:
        n = values.numel()
        if not 1 <= k <= n:
            raise ValueError(f"k must be in [1, {n}], got {k}")
        return float(torch.kthvalue(values.to(torch.float32), n - k + 1).values)
    import torch.distributed as dist

    keys = _ordered_keys(values)
    prefix = 0  # the high bits of the answer found so far
    remaining = k  # rank of the answer among candidates that share the prefix
    for shift in (24, 16, 8, 0):
        if shift == 24:
            cand = keys
        else:
            cand = keys[(keys >> (shift + 8)) == (prefix >> (shift + 8))]
        digits = (cand >> shift) & 0xFF
        hist = torch.bincount(digits, minlength=256).to(torch.int64)
        dist.all_reduce(hist, op=dist.ReduceOp.SUM, group=group)
        counts = hist.flip(0).cumsum(0)  # counts[j] = candidates with digit >= 255 - j
        total = int(counts[-1])
        if not 1 <= remaining <= total:
            raise ValueError(f"k must be in [1, {total}] over the group, got {k}")
        j = int(torch.searchsorted(counts, torch.tensor(remaining, dtype=counts.dtype, device=counts.device)))
        digit = 255 - j
        above = int(counts[j - 1]) if j > 0 else 0
        remaining -= above
        prefix |= digit << shift
    return _key_to_float(prefix)


def _global_n(n: int, group, device) -> int:
    if group is None:
        return n
    import torch.distributed as dist

    count = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return int(count)


def _top_threshold(values: torch.Tensor, n_local: int, ratio: float, group) -> float | None:
    """The key a member needs to be in the top ``ratio`` share (None: select nothing).

    ``values`` holds the local members' keys and may hold extra ``-inf`` fillers (padding), which rank last.
    """
    k = top_count(ratio, _global_n(n_local, group, values.device))
    return None if k == 0 else kth_largest(values, k, group)


def _top_share(key: torch.Tensor, members: torch.Tensor, ratio: float, group) -> torch.Tensor:
    """Bool mask of ``members`` whose ``key`` is among the top ``ratio`` share (threshold, ties kept)."""
    values = key[members]  # the members' keys, compacted
    threshold = _top_threshold(values, values.numel(), ratio, group)
    if threshold is None:
        return torch.zeros_like(members)
    return members & (key >= threshold)


def _paper_rule_by_rows(weights, key, valid, adv_seq, ratio, w, m, variant, group) -> None:
    """The paper's rule for per-sequence advantages, in place: whole rows are gathered by advantage sign, so
    no per-token mask or compaction pass is needed (padding is -inf and never reaches a finite threshold)."""
    key = torch.where(valid, key, float("-inf"))
    counts = valid.sum(dim=1)
    for sign, value in ((1, w), (-1, m)):
        if sign < 0 and variant != "C2":
            continue
        rows = (adv_seq > 0 if sign > 0 else adv_seq < 0).nonzero().squeeze(1)
        sub = key.index_select(0, rows)
        threshold = _top_threshold(sub.reshape(-1), int(counts[rows].sum()), ratio, group)
        if threshold is None:
            continue
        fill = torch.where(sub >= threshold, value, 1.0).to(weights.dtype)
        weights.index_copy_(0, rows, fill)


def stare_token_weights(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    top_ratio: float = 0.1,
    w: float = 1.1,
    m: float = 0.9,
    variant: str = "O1",
    gate_on: bool = True,
    selection: str = "quantile",
    phi: torch.Tensor | None = None,
    damp: float = 1.0,
    group=None,
    micro_batch_size: int | None = None,
    phi_cap: float | None = None,
    direction: int = 1,
    phi_tol: float = 0.0,
) -> torch.Tensor:
    """Per-token STARE weights, shaped like ``logprobs`` (float32): 1 except on the selected tokens.

    - ``logprobs``: detached log-probs of the sampled tokens (the old policy's, for the step's batch).
    - ``advantages``: ``[B, T]`` or per-sequence ``[B]``; ``mask``: 1 on response tokens.
    - ``top_ratio`` P, ``w`` W, ``m`` M, ``variant`` O1 | C2: the paper's rule. ``gate_on=False`` returns
      all ones, so the loss is exactly the base loss.
    - ``selection``: ``quantile`` (paper: top share by surprisal) | ``phi`` (exact sign of Phi; needs
      ``phi``, optionally ``phi_cap`` to keep only the top share by Phi).
    - ``damp``: weight on A > 0, Phi < 0 tokens (the entropy-lowering majority; needs ``phi``).
    - ``group``: torch.distributed process group; selection is then exact over all ranks' tokens.
    - ``micro_batch_size``: the reference's per-micro-batch rule: apply the selection separately to each
      consecutive block of that many sequences (so it depends on the split). ``None`` (default): one
      selection over everything passed in.
    - ``direction``: +1 raises entropy (the paper), -1 mirrors the rule to lower it.
    - ``phi_tol`` (``selection="phi"``): within ``phi_tol`` times the step's mean |A Phi| of zero, the weight moves
      linearly between the two the sign rule picks from, instead of jumping at Phi = 0 (module docstring).
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be shaped [B, T], got shape {tuple(logprobs.shape)}")
    check_same_shape("logprobs", logprobs, mask=mask, phi=phi)
    advantages = broadcast_advantages(advantages, logprobs)
    check_range("top_ratio", top_ratio, 0, 1)
    check_range("w", w, 0, None, low_open=True)
    check_range("m", m, 0, None, low_open=True)
    check_range("damp", damp, 0, None, low_open=True)
    check_choice("variant", variant, VARIANTS)
    check_choice("selection", selection, SELECTIONS)
    check_choice("direction", direction, (1, -1))
    if phi_cap is not None:
        check_range("phi_cap", phi_cap, 0, 1)
    check_range("phi_tol", phi_tol, 0, None)
    if selection == "phi" and phi is None:
        raise ValueError("selection='phi' needs the phi tensor (from entropy_sensitivity)")
    if damp != 1.0 and phi is None:
        raise ValueError("damp != 1 needs the phi tensor (from entropy_sensitivity) to find the majority tokens")
    if micro_batch_size is not None:
        check_range("micro_batch_size", micro_batch_size, 1, None)
        if group is not None:
            raise ValueError("micro_batch_size (per-micro-batch selection) and group (global selection) exclude each other")

    ones = torch.ones(logprobs.shape, dtype=torch.float32, device=logprobs.device)
    if not gate_on:
        return ones
    valid = mask.bool()
    check_finite(valid, logprobs=logprobs, phi=phi)
    check_finite(None if advantages.stride(-1) == 0 else valid,
                 advantages=advantages[:, :1] if advantages.stride(-1) == 0 else advantages)

    if micro_batch_size is not None and micro_batch_size < logprobs.shape[0]:
        kwargs = dict(top_ratio=top_ratio, w=w, m=m, variant=variant, selection=selection, damp=damp,
                      phi_cap=phi_cap, direction=direction, phi_tol=phi_tol)
        parts = []
        for start in range(0, logprobs.shape[0], micro_batch_size):
            rows = slice(start, start + micro_batch_size)
            parts.append(stare_token_weights(
                logprobs[rows], advantages[rows], mask[rows],
                phi=None if phi is None else phi[rows], **kwargs))
        return torch.cat(parts, dim=0)

    per_sequence = advantages.stride(-1) == 0  # [B] advantages broadcast along T
    weights = ones
    if selection == "quantile":
        key = logprobs.detach().to(torch.float32)
        key = key.neg() if direction == 1 else key  # surprisal; its negation mirrors the rule
        if per_sequence and damp == 1.0:
            _paper_rule_by_rows(weights, key, valid, advantages[:, 0], top_ratio, w, m, variant, group)
            return weights
    adv = advantages[:, :1] if per_sequence else advantages  # a [B, 1] view broadcasts without a copy
    pos = valid & (adv > 0)
    neg = valid & (adv < 0)
    if selection == "phi" and phi_tol > 0:
        _phi_rule_with_tolerance(weights, phi.detach().to(torch.float32) * direction, adv, valid, pos, neg, w, m,
                                 damp, variant, phi_cap, phi_tol, group)
        return weights
    if selection == "quantile":
        l_pos = _top_share(key, pos, top_ratio, group)
        l_neg = _top_share(key, neg, top_ratio, group) if variant == "C2" else None
    else:
        signed_phi = phi.detach().to(torch.float32) * direction
        raising = signed_phi > 0
        l_pos = pos & raising
        l_neg = (neg & raising) if variant == "C2" else None
        if phi_cap is not None:
            l_pos = _top_share(signed_phi, l_pos, phi_cap, group)
            if l_neg is not None:
                l_neg = _top_share(signed_phi, l_neg, phi_cap, group)
    weights.masked_fill_(l_pos, w)
    if l_neg is not None:
        weights.masked_fill_(l_neg, m)
    if damp != 1.0:
        weights.masked_fill_(pos & (phi.detach().to(torch.float32) * direction < 0), damp)
    return weights


def _phi_rule_with_tolerance(weights, signed_phi, adv, valid, pos, neg, w, m, damp, variant, phi_cap, phi_tol,
                             group) -> None:
    """The exact rule with ``phi_tol``, in place: a token counts as entropy-raising by the share r of a ramp
    (``_phi_ramp``: 0 up to Phi |A| = -tau, 1 from +tau, 1/2 at zero), so A > 0 tokens get damp + r (W - damp) and
    A < 0 tokens (C2) 1 + r (M - 1). A Phi whose sign is noise gets the mean of the two weights the sign rule
    would pick by a coin flip, deterministically."""
    share = _phi_ramp(signed_phi, adv, valid, phi_tol, group)
    l_pos = pos & (share > 0)
    l_neg = neg & (share > 0) if variant == "C2" else None
    if phi_cap is not None:
        l_pos = _top_share(signed_phi, l_pos, phi_cap, group)
        if l_neg is not None:
            l_neg = _top_share(signed_phi, l_neg, phi_cap, group)
    weights.masked_fill_(pos, damp)
    weights.copy_(torch.where(l_pos, damp + share * (w - damp), weights))
    if l_neg is not None:
        weights.copy_(torch.where(l_neg, 1.0 + share * (m - 1.0), weights))


def _phi_ramp(signed_phi: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor, phi_tol: float, group
              ) -> torch.Tensor:
    """The phi_tol rule's share r in [0, 1] per token: clamp((|A| Phi + tau) / (2 tau), 0, 1), with
    tau = max(phi_tol * mean |A Phi| over the A != 0 response tokens (all ranks), PHI_TOL_FLOOR)."""
    y = adv.to(torch.float32).abs() * signed_phi
    counted = valid & (adv != 0)
    x = torch.where(counted, y.abs(), 0.0)
    sums = torch.stack([x.sum(dtype=torch.float64), counted.sum().to(torch.float64)])
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    mean = sums[0] / sums[1].clamp(min=1.0)
    tau = torch.clamp(phi_tol * mean, min=PHI_TOL_FLOOR).to(torch.float32)
    return ((y + tau) / (2 * tau)).clamp(0.0, 1.0)




def reweight_sums(weights: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``reweight_stats`` as (numerator, denominator) pairs of 0-dim float32 tensors, before the division.

    Summing both over data-parallel ranks before dividing gives the exact shares over all ranks' tokens.
    """
    advantages = broadcast_advantages(advantages, weights)
    valid = mask.bool()
    changed = weights != 1.0
    pos = valid & (advantages > 0)
    neg = valid & (advantages < 0)
    return {
        "positive_reweight_ratio": ((changed & pos).to(torch.float32).sum(), pos.to(torch.float32).sum()),
        "negative_reweight_ratio": ((changed & neg).to(torch.float32).sum(), neg.to(torch.float32).sum()),
        "mean_weight": ((weights.to(torch.float32) * valid).sum(), valid.to(torch.float32).sum()),
    }


def reweight_stats(weights: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Telemetry of a weight tensor: share of A > 0 (A < 0) tokens whose weight is not 1, and the mean weight.

    Keys match the reference's logs: ``positive_reweight_ratio``, ``negative_reweight_ratio``, ``mean_weight``.
    Shapes: ``weights``, ``mask`` ``[B, T]``; ``advantages`` ``[B, T]`` or ``[B]``. Values: 0-dim tensors (0 over
    an empty set).
    """
    return {k: num / den.clamp(min=1.0) for k, (num, den) in reweight_sums(weights, advantages, mask).items()}
