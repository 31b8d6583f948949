"""The Delightful Policy Gradient gate (``delight_gate_weights``, the ``dg`` token rule) against independent
computations: a loop over tokens with math.exp, central differences of the gated loss written out by hand, and the
on-policy gradient the paper states (-A sigmoid(A s / eta) per token)."""
from __future__ import annotations

import math

import pytest
import torch

from stare.algorithms import EntropyStats, delight_gate_weights, get_algorithm, policy_loss, stare_step
from stare.algorithms.baselines import DG_NEAR, delight_gate_sums
from test_entropy_controls import step_batch


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@pytest.mark.parametrize("eta", [1.0, 0.25, 3.0])
def test_the_gate_against_a_loop_over_tokens(eta):
    """sigmoid(A (-log p) / eta) token by token; 1 on padding; 1/2 where A = 0; per-sequence advantages give the
    per-token ones; a surprising A > 0 token keeps more than an expected one, a surprising A < 0 token less."""
    logp = torch.log(torch.tensor([[0.9, 0.5, 0.01, 0.3], [0.9, 0.5, 0.01, 0.2], [0.7, 0.05, 0.6, 0.4]]))
    adv = torch.tensor([[1.5, 1.5, 1.5, 1.5], [-0.7, -0.7, -0.7, -0.7], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    w = delight_gate_weights(logp, adv, mask, eta=eta)
    assert w.dtype == torch.float32
    for b in range(3):
        for t in range(4):
            if not mask[b, t]:
                assert float(w[b, t]) == 1.0
                continue
            want = _sigmoid(float(adv[b, t]) * -float(logp[b, t]) / eta)
            assert float(w[b, t]) == pytest.approx(want, rel=1e-6), (b, t)
    assert float(w[2, 0]) == float(w[2, 1]) == 0.5
    assert float(w[0, 2]) > float(w[0, 1]) > float(w[0, 0]) > 0.5  # A > 0: more surprise, more gradient
    assert float(w[1, 2]) < float(w[1, 1]) < float(w[1, 0]) < 0.5  # A < 0: more surprise, less gradient
    per_seq = delight_gate_weights(logp, torch.tensor([1.5, -0.7, 0.0]), mask, eta=eta)
    assert torch.equal(per_seq, w)


def test_the_gate_telemetry_by_counting():
    """gate_mean, gate_low_share and gate_high_share over the A != 0 response tokens, counted by hand."""
    logp = torch.log(torch.tensor([[0.99, 0.5, 1e-3, 0.5], [0.99, 0.5, 1e-3, 0.5]]))
    adv = torch.tensor([[2.0, 2.0, 2.0, 0.0], [-2.0, -2.0, -2.0, 2.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    sums = delight_gate_sums(delight_gate_weights(logp, adv, mask), adv, mask)
    gates = [_sigmoid(a * -math.log(p)) for a, p in ((2, 0.99), (2, 0.5), (2, 1e-3), (-2, 0.99), (-2, 0.5),
                                                     (-2, 1e-3))]  # the six A != 0 response tokens
    assert float(sums["gate_mean"][1]) == 6.0
    assert float(sums["gate_mean"][0]) == pytest.approx(sum(gates), rel=1e-6)
    assert float(sums["gate_low_share"][0]) == sum(g < DG_NEAR for g in gates) == 1  # (-2, 1e-3): 1e-6
    assert float(sums["gate_high_share"][0]) == sum(g > 1 - DG_NEAR for g in gates) == 1  # (2, 1e-3)


def test_bad_settings_are_refused():
    logp, adv, mask = torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="eta"):
        delight_gate_weights(logp, adv, mask, eta=0.0)
    with pytest.raises(ValueError, match="logprobs"):
        delight_gate_weights(logp, adv, torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="dg_eta"):
        get_algorithm("dg", dg_eta=-1.0)
    with pytest.raises(ValueError, match="dg_eta .* applies to token_rule dg only"):
        get_algorithm("grpo", dg_eta=2.0)


def test_the_gated_loss_and_its_gradient_against_finite_differences():
    """policy_loss with the gate as weights, in float64: the value against a loop over tokens of
    gate * max(-A r, -A clip(r, 0.8, 1.2)) / N, the gradient in the current log-probs against central differences of
    that loop. The gate reads the old log-probs, so it is a constant of the current ones."""
    g = torch.Generator().manual_seed(3)
    B, T, eta = 3, 5, 0.7
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 4] = mask[2, 3:] = False
    old = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 4).clamp(max=-1e-3)
    new = (old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([0.9, -1.3, 0.4], dtype=torch.float64)
    gate = delight_gate_weights(old, adv, mask, eta=eta).to(torch.float64)

    def by_hand(cur):
        total = 0.0
        for b in range(B):
            for t in range(T):
                if not mask[b, t]:
                    continue
                a, s = float(adv[b]), -float(old[b, t])
                r = torch.exp(cur[b, t] - old[b, t])
                term = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
                total = total + _sigmoid(a * s / eta) * term
        return total / int(mask.sum())

    loss, _ = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2, weights=gate)
    assert float(loss.detach()) == pytest.approx(float(by_hand(new.detach())), rel=1e-6)  # the gate is float32: 1e-7 relative
    loss.backward()
    eps = 1e-6
    for idx in [(0, 0), (0, 3), (1, 2), (2, 1), (0, 4)]:  # the last one is padding
        plus, minus = new.detach().clone(), new.detach().clone()
        plus[idx] += eps
        minus[idx] -= eps
        fd = (float(by_hand(plus)) - float(by_hand(minus))) / (2 * eps)
        assert float(new.grad[idx]) == pytest.approx(fd, rel=1e-5, abs=1e-12), idx
    assert float(new.grad[0, 4]) == 0.0


def test_on_policy_the_gradient_is_the_papers_gated_score():
    """At the first update (current = old log-probs, every ratio 1, nothing clipped) the gradient of the loss in
    each token's log-prob is -A sigmoid(A (-log p) / eta) / N: the paper's gated policy-gradient term."""
    g = torch.Generator().manual_seed(8)
    B, T = 4, 6
    mask = torch.rand(B, T, generator=g) > 0.2
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 5
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    cur = old.clone().requires_grad_(True)
    gate = delight_gate_weights(old, adv, mask)
    loss, _ = policy_loss(cur, old, adv, mask, weights=gate)
    loss.backward()
    n = int(mask.sum())
    for b in range(B):
        for t in range(T):
            a = float(adv[b])
            want = -a * _sigmoid(a * -float(old[b, t])) / n if mask[b, t] else 0.0
            assert float(cur.grad[b, t]) == pytest.approx(want, rel=1e-6, abs=1e-12), (b, t)


def test_the_dg_step_gates_the_loss_exactly():
    """Through stare_step and policy_loss on dg's defaults (eta 1, clip 0.2/0.2, token-mean): the loss written out by
    hand, and the step's telemetry."""
    cfg = get_algorithm("dg")
    assert (cfg.token_rule, cfg.dg_eta, cfg.clip_low, cfg.clip_high, cfg.dual_clip, cfg.agg,
            cfg.dynamic_sampling, cfg.stare, cfg.entropy_bonus) == \
        ("dg", 1.0, 0.2, 0.2, None, "token-mean", False, False, False)
    mask, old, new, adv, ent, phi = step_batch()  # the batch the entropy-adv step test uses
    step = stare_step(None, cfg, old, adv, mask, EntropyStats(ent, -old, phi))
    assert step.penalty is None
    loss, _ = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2, weights=step.weights)
    a = adv[:, None]
    gate = torch.sigmoid(a * -old)
    ratio = torch.exp(new - old)
    per_token = gate * torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    assert float(loss) == pytest.approx(float((per_token * mask).sum() / mask.sum()), rel=1e-6)
    m = step.metrics
    acted = mask & (a != 0)
    assert m["stare/gate_mean"] == pytest.approx(float(gate[acted].mean()), rel=1e-6)
    assert m["stare/gate_low_share"] == pytest.approx(float((gate[acted] < 0.1).float().mean()))
    assert m["stare/gate_high_share"] == pytest.approx(float((gate[acted] > 0.9).float().mean()))
    # every response token's weight differs from 1 (A = 0 tokens carry 1/2): the shares count the weights
    assert m["stare/positive_reweight_ratio"] == pytest.approx(1.0)
    assert m["stare/negative_reweight_ratio"] == pytest.approx(1.0)
    assert m["stare/mean_weight"] == pytest.approx(float(step.weights[mask].mean()), rel=1e-6)
    assert m["stare/masked_share"] == 0.0
