"""The two entropy controls beside STARE's gate, against independent computations: Skywork-OR1's adaptive entropy
bonus (``EntropyCoef``, ``entropy_bonus_loss``) and entropy-based advantage shaping (``entropy_advantage_weights``,
the ``entropy-adv`` token rule)."""
from __future__ import annotations

import math

import pytest
import torch

from stare.algorithms import (
    EntropyCoef,
    EntropyStats,
    entropy_advantage_weights,
    entropy_bonus_loss,
    get_algorithm,
    policy_loss,
    stare_step,
    token_entropy,
)
from stare.algorithms.baselines import entropy_advantage_sums

# ---- the adaptive coefficient ----------------------------------------------------------------------------------


def test_the_adaptive_coefficient_over_a_scripted_entropy_trace_by_hand():
    """target 0.2, delta 0.05 within [0, 0.12]: up (and applied) at or below the target, down (and not applied)
    above it, held at both ends; the trace touches the target exactly (0.2 counts as below)."""
    c = EntropyCoef(0.0, adaptive=True, target=0.2, delta=0.05, coef_min=0.0, coef_max=0.12)
    trace = [0.5, 0.19, 0.2, 0.1, 0.05, 0.3, 0.3, 0.3, 0.3, 0.15]
    applied = [c.update(h) for h in trace]
    # coefficient after each step:  0 (held at min), .05, .10, .12 (held at max), .12, .07, .02, 0, 0, .05
    assert applied == pytest.approx([0.0, 0.05, 0.10, 0.12, 0.12, 0.0, 0.0, 0.0, 0.0, 0.05], abs=1e-15)
    assert c.coef == pytest.approx(0.05) and c.steps == len(trace)
    # a fixed bonus is its coefficient every step, whatever the entropy
    fixed = EntropyCoef(0.01)
    assert [fixed.update(h) for h in trace] == [0.01] * len(trace)


def _trl_adaptive(trace, *, coef, target, delta, coef_min, coef_max):
    """TRL's GRPOTrainer (1.x, use_adaptive_entropy), as its _compute_loss reads: each optimizer step applies the
    coefficient left by the previous step's update, gated on the previous step's measured entropy, then updates the
    coefficient from this step's entropy (measured during the update). Returns the applied coefficient per step."""
    applied, last = [], None
    for entropy in trace:
        applied.append(coef if last is not None and last <= target else 0.0)
        if entropy <= target:
            coef = min(coef + delta, coef_max)
        else:
            coef = max(coef - delta, coef_min)
        last = entropy
    return applied


@pytest.mark.parametrize("settings", [
    dict(coef=0.0, target=0.2, delta=0.005, coef_min=0.0, coef_max=1.0),  # TRL's defaults
    dict(coef=0.3, target=0.6, delta=0.1, coef_min=0.05, coef_max=0.45),  # both clamps reached
])
def test_the_adaptive_coefficient_is_trls_one_step_earlier(settings):
    """TRL measures the entropy during the update, so its step k + 1 applies what ours applies at step k: we have
    the old policy's entropy before the update (Skywork-OR1's order). Same inputs, same numbers."""
    g = torch.Generator().manual_seed(3)
    trace = (settings["target"] + 0.3 * torch.randn(40, generator=g, dtype=torch.float64)).abs().tolist()
    trace[5] = trace[6] = settings["target"]  # the boundary, twice
    ours = EntropyCoef(settings["coef"], adaptive=True, target=settings["target"], delta=settings["delta"],
                       coef_min=settings["coef_min"], coef_max=settings["coef_max"])
    mine = [ours.update(h) for h in trace]
    trl = _trl_adaptive(trace + [0.0], **settings)  # one more step for TRL to apply the last update
    assert mine == trl[1:]  # the same floats: the same additions in the same order
    assert len(set(mine)) > 3  # the trace moves the coefficient


def test_the_coefficient_state_resumes_to_the_same_sequence():
    trace = [0.1, 0.1, 0.5, 0.1, 0.1, 0.1, 0.5, 0.5]
    straight = EntropyCoef(0.0, adaptive=True, delta=0.03)
    expected = [straight.update(h) for h in trace]
    first = EntropyCoef(0.0, adaptive=True, delta=0.03)
    head = [first.update(h) for h in trace[:3]]
    resumed = EntropyCoef(0.0, adaptive=True, delta=0.03)
    resumed.load_state_dict(first.state_dict())
    assert head + [resumed.update(h) for h in trace[3:]] == expected
    with pytest.raises(ValueError, match="'paper', not 'entropy_coef'"):
        resumed.load_state_dict({"kind": "paper"})


# ---- the bonus's loss term ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_the_bonus_term_and_its_gradient_against_finite_differences(agg):
    """-coef * aggregated entropy of softmax(z): the value against a loop over tokens, the gradient against central
    differences of that loop, in float64 (padding gets neither value nor gradient)."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 4, 5
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    coef, norm_len = 0.37, 6

    def by_hand(logits):
        total, per_seq = 0.0, []
        for b in range(B):
            s = 0.0
            for t in range(T):
                if mask[b, t]:
                    p = torch.softmax(logits[b, t], -1)
                    s = s - (p * torch.log(p)).sum()
            per_seq.append((s, int(mask[b].sum())))
            total = total + s
        if agg == "token-mean":
            e = total / int(mask.sum())
        elif agg == "seq-mean-token-mean":
            e = sum(s / n for s, n in per_seq) / B
        else:
            e = total / (B * norm_len)
        return -coef * e

    loss, term = entropy_bonus_loss(token_entropy(z), mask, coef, agg=agg, norm_len=norm_len)
    assert float(loss) == pytest.approx(float(by_hand(z)), rel=1e-12)
    assert float(loss) == pytest.approx(-coef * float(term), rel=1e-15)
    loss.backward()
    eps = 1e-6
    for idx in [(0, 0, 1), (0, 2, 4), (1, 1, 0), (2, 3, 2), (1, 3, 3)]:  # the last one is padding
        plus, minus = z.detach().clone(), z.detach().clone()
        plus[idx] += eps
        minus[idx] -= eps
        fd = (float(by_hand(plus)) - float(by_hand(minus))) / (2 * eps)
        assert float(z.grad[idx]) == pytest.approx(fd, rel=1e-6, abs=1e-10), idx
    assert float(z.grad[1, 3].abs().max()) == 0.0


# ---- entropy-based advantage shaping ----------------------------------------------------------------------------


def test_shaped_advantages_against_a_loop_at_the_bound_and_on_both_signs():
    """weight * A == A + min(alpha H, |A| / kappa) token by token; the sign never flips; A = 0 and padding keep
    weight 1; tokens exactly at the bound and beyond it are held at |A| / kappa."""
    alpha, kappa = 0.4, 2.0
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-0.8, -0.8, -0.8, -0.8], [0.0, 0.5, -2.0, 3.0]])
    # entropies: below the bound, exactly at it (alpha H = |A| / kappa), beyond it, and a padded position
    ent = torch.tensor([[0.5, 1.25, 4.0, 9.0], [0.25, 1.0, 3.0, 0.0], [2.0, 0.0, 2.5, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    w = entropy_advantage_weights(adv, ent, mask, alpha=alpha, kappa=kappa)
    for b in range(3):
        for t in range(4):
            a, h = float(adv[b, t]), float(ent[b, t])
            if not mask[b, t] or a == 0:
                assert float(w[b, t]) == 1.0
                continue
            shaped = a + min(alpha * h, abs(a) / kappa)
            assert float(w[b, t]) * a == pytest.approx(shaped, rel=1e-6), (b, t)
            assert math.copysign(1, shaped) == math.copysign(1, a)
    assert float(w[0, 1]) == pytest.approx(1.5) and float(w[0, 2]) == pytest.approx(1.5)  # at and beyond the bound
    assert float(w[1, 2]) == pytest.approx(0.5)  # A < 0 held at |A| / 2: its size halves
    assert float(w[1, 3]) == 1.0  # H = 0: unchanged
    # per-sequence advantages give the same weights as the same values per token
    per_seq = torch.tensor([1.0, -0.8, 0.0])
    w_seq = entropy_advantage_weights(per_seq, ent, mask, alpha=alpha, kappa=kappa)
    assert torch.equal(w_seq[:2], w[:2])
    # telemetry by counting: shaped = A != 0 and H > 0 over A != 0; clipped = alpha H >= |A| / kappa over shaped
    sums = entropy_advantage_sums(adv, ent, mask, alpha=alpha, kappa=kappa)
    # 10 response tokens with A != 0; (1, 3) and (2, 1) have H 0; at or beyond the bound: (0, 1), (0, 2), (1, 1),
    # (1, 2), (2, 2), (2, 3)
    assert [float(x) for x in sums["shaped_share"]] == [8.0, 10.0]
    assert [float(x) for x in sums["shaping_clipped_share"]] == [6.0, 8.0]


def step_batch():
    """A step's numbers for the token rules' loss-by-hand tests: 6 sequences of 5 tokens (one cut at 3), the old and
    the trained log-probs, per-sequence advantages of both signs and one 0, the old policy's entropy and Phi."""
    g = torch.Generator().manual_seed(5)
    B, T = 6, 5
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    old = -torch.rand(B, T, generator=g) * 3
    new = old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.tensor([1.2, -0.4, 0.0, 0.7, -1.5, 0.3])
    ent = torch.rand(B, T, generator=g) * 2
    phi = torch.randn(B, T, generator=g)
    return mask, old, new, adv, ent, phi


def test_the_entropy_adv_step_shapes_the_loss_exactly():
    """Through stare_step and policy_loss: the clipped loss with the shaped advantages written out by hand."""
    cfg = get_algorithm("entropy-adv")
    mask, old, new, adv, ent, phi = step_batch()
    step = stare_step(None, cfg, old, adv, mask, EntropyStats(ent, -old, phi))
    loss, _ = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2, weights=step.weights)
    shaped = adv[:, None] + torch.minimum(0.4 * ent, adv.abs()[:, None] / 2.0)
    shaped = torch.where(adv[:, None] == 0, 0.0, shaped)
    ratio = torch.exp(new - old)
    per_token = torch.maximum(-shaped * ratio, -shaped * ratio.clamp(0.8, 1.2))
    assert float(loss) == pytest.approx(float((per_token * mask).sum() / mask.sum()), rel=1e-6)
    m = step.metrics
    nonzero = mask & (adv[:, None] != 0)
    assert m["stare/shaped_share"] == pytest.approx(1.0)  # every entropy here is > 0
    clipped = nonzero & (0.4 * ent >= adv.abs()[:, None] / 2)
    assert m["stare/shaping_clipped_share"] == pytest.approx(float(clipped.sum() / nonzero.sum()))
    pos = mask & (adv[:, None] > 0)
    assert m["stare/positive_reweight_ratio"] == pytest.approx(1.0)  # every A > 0 token is boosted
    boosted = pos & (phi > 0)
    assert m["stare/boosted_phi_pos_share"] == pytest.approx(float(boosted.sum() / pos.sum()))
    assert m["stare/masked_share"] == 0.0
