"""STEER's token weights (``steer_change``, ``steer_weights``, the ``steer`` token rule) against independent
computations: p and H from softmax over random logits in float64, the estimated entropy change and both mappings
written out token by token as the source states them, the gated loss by hand through ``stare_step``."""
from __future__ import annotations

import math

import pytest
import torch

from stare.algorithms import EntropyStats, get_algorithm, policy_loss, stare_step
from stare.algorithms.baselines import STEER_MAX_FLOOR, steer_change, steer_sums, steer_weights


def _batch(seed=0, B=4, T=6, V=7, scale=1.0):
    """Sampled tokens of random logits: the old policy's log-probs and entropies computed here in float64, an
    advantage per sequence (one of them 0), a ragged mask."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    probs = torch.softmax(z, -1)
    tokens = torch.multinomial(probs.reshape(-1, V), 1, generator=g).reshape(B, T)
    p = probs.gather(-1, tokens[..., None])[..., 0]
    h = -(probs * probs.log()).sum(-1)
    adv = torch.tensor([1.3, -0.6, 0.0, 0.9][:B], dtype=torch.float64) * scale
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 4:] = mask[3, 2:] = False
    return p.log().float(), adv.float(), h.float(), mask, p, h


def _by_hand(p, h, adv, mask, mapping, w_min, w_max):
    """Omega and the weights, a loop over tokens in float64 (the batch's max and min over the response tokens)."""
    B, T = mask.shape
    omega = {(b, t): float(adv[b]) * (1 - float(p[b, t])) * (math.log(float(p[b, t])) + float(h[b, t]))
             for b in range(B) for t in range(T) if mask[b, t]}
    sizes = {k: abs(v) for k, v in omega.items()}
    top, low = max(sizes.values()), min(sizes.values())
    w = {}
    for key, m in sizes.items():
        if mapping == "exp":
            k = -math.log(w_min) / max(top, STEER_MAX_FLOOR)
            w[key] = min(max(math.exp(-k * m), w_min), 1.0)
        elif top == low:
            w[key] = (w_min + w_max) / 2
        else:
            w[key] = min(max(w_max - (m - low) * (w_max - w_min) / (top - low), w_min), w_max)
    return omega, w


@pytest.mark.parametrize("mapping,w_min,w_max", [("exp", 0.8, 1.2), ("exp", 0.3, 1.2), ("linear", 0.8, 1.2),
                                                 ("linear", 0.5, 2.0)])
def test_the_change_and_the_weights_against_a_loop(mapping, w_min, w_max):
    logp, adv, ent, mask, p, h = _batch()
    omega, want = _by_hand(p, h, adv, mask, mapping, w_min, w_max)
    got_omega = steer_change(logp, adv, ent, mask)
    w = steer_weights(logp, adv, ent, mask, mapping=mapping, weight_min=w_min, weight_max=w_max)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                assert float(got_omega[b, t]) == 0.0 and float(w[b, t]) == 1.0
                continue
            assert float(got_omega[b, t]) == pytest.approx(omega[b, t], rel=1e-5, abs=1e-7), (b, t)
            assert float(w[b, t]) == pytest.approx(want[b, t], rel=1e-5), (b, t)
    sizes = got_omega.abs()[mask]
    assert float(w[mask][sizes.argmax()]) == pytest.approx(w_min, rel=1e-6)  # the largest change gets the floor
    zero_adv = mask & (adv[:, None] == 0)  # A = 0: no change, the top weight of the mapping
    assert torch.allclose(w[zero_adv], torch.tensor(1.0 if mapping == "exp" else w_max))


def test_small_changes_are_weighed_against_the_floor_of_the_max():
    """exp: a batch whose largest |Omega| is under 0.02 divides by 0.02, so no token reaches the floor."""
    logp, adv, ent, mask, p, h = _batch(scale=1e-3)
    omega, want = _by_hand(p, h, adv, mask, "exp", 0.8, 1.2)
    assert max(abs(v) for v in omega.values()) < STEER_MAX_FLOOR
    w = steer_weights(logp, adv, ent, mask)
    assert float(w[mask].min()) > 0.8
    for (b, t), value in want.items():
        assert float(w[b, t]) == pytest.approx(value, rel=1e-6)


def test_the_sign_and_the_telemetry_by_counting():
    """Omega < 0 (the source's sign for a rising entropy) where A > 0 and the token is more likely than the
    distribution's typical token (log p + H > 0 ... < 0 flips it); the floor share and the raise share counted."""
    logp, adv, ent, mask, p, h = _batch(seed=4)
    omega = steer_change(logp, adv, ent, mask)
    for b, t in zip(*torch.nonzero(mask, as_tuple=True)):
        expect = math.copysign(1, float(adv[b])) * math.copysign(1, math.log(float(p[b, t])) + float(h[b, t]))
        if float(adv[b]) != 0:
            assert math.copysign(1, float(omega[b, t])) == expect
    w = steer_weights(logp, adv, ent, mask)
    sums = steer_sums(logp, adv, ent, mask, w, weight_min=0.8)
    moving = mask & (omega != 0)
    assert [float(x) for x in sums["steer_raise_share"]] == [float((moving & (omega < 0)).sum()),
                                                             float(moving.sum())]
    assert [float(x) for x in sums["steer_floor_share"]] == [1.0, float(mask.sum())]  # one token holds the max


def test_bad_settings_are_refused():
    logp, adv, ent, mask, *_ = _batch()
    with pytest.raises(ValueError, match="mapping"):
        steer_weights(logp, adv, ent, mask, mapping="log")
    with pytest.raises(ValueError, match="weight_min"):
        steer_weights(logp, adv, ent, mask, weight_min=1.0)
    with pytest.raises(ValueError, match="weight_max 0.7 must be > weight_min 0.8"):
        steer_weights(logp, adv, ent, mask, mapping="linear", weight_max=0.7)
    with pytest.raises(ValueError, match="entropy"):
        steer_weights(logp, adv, ent[:, :2], mask)
    with pytest.raises(ValueError, match="steer_weight_min"):
        get_algorithm("steer", steer_weight_min=0.0)
    with pytest.raises(ValueError, match="steer_mapping .* applies to token_rule steer only"):
        get_algorithm("dapo", steer_mapping="linear")


def test_the_steer_step_weighs_the_loss_exactly():
    """stare_step on steer's defaults (exp, 0.8; clip 0.2/0.28, dual clip 10, token-mean, no dynamic sampling), then
    policy_loss: the loss written out by hand with the weights of the loop above."""
    cfg = get_algorithm("steer")
    assert (cfg.token_rule, cfg.steer_mapping, cfg.steer_weight_min, cfg.clip_low, cfg.clip_high, cfg.dual_clip,
            cfg.agg, cfg.dynamic_sampling, cfg.overlong_shaping, cfg.std_norm, cfg.stare) == \
        ("steer", "exp", 0.8, 0.2, 0.28, 10.0, "token-mean", False, False, True, False)
    assert cfg.needs_entropy
    logp, adv, ent, mask, p, h = _batch(seed=2)
    g = torch.Generator().manual_seed(9)
    new = logp + 0.4 * torch.randn(logp.shape, generator=g)
    phi = torch.randn(logp.shape, generator=g)
    step = stare_step(None, cfg, logp, adv, mask, EntropyStats(ent, -logp, phi))
    assert step.penalty is None
    loss, _ = policy_loss(new, logp, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=10.0, weights=step.weights)
    _, want = _by_hand(p, h, adv, mask, "exp", 0.8, 1.2)
    total = 0.0
    for (b, t), w in want.items():
        a, r = float(adv[b]), math.exp(float(new[b, t]) - float(logp[b, t]))
        term = max(-a * r, -a * min(max(r, 0.8), 1.28))
        if a < 0:
            term = min(term, -a * 10.0)
        total += w * term
    assert float(loss) == pytest.approx(total / int(mask.sum()), rel=1e-5)
    m = step.metrics
    assert m["stare/steer_floor_share"] == pytest.approx(1 / int(mask.sum()))
    assert 0 < m["stare/steer_raise_share"] < 1
    assert m["stare/mean_weight"] == pytest.approx(sum(want.values()) / len(want), rel=1e-5)
