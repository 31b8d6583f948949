"""policy_loss against a per-token Python reference, micro-batch accumulation, gradcheck, no host sync."""
import math

import pytest
import torch

from stare.algorithms import AGGREGATIONS, policy_loss


def make_batch(B=4, T=9, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    new = old + torch.randn(B, T, generator=g, dtype=dtype) * 0.4  # some ratios clip, some do not
    adv = torch.randn(B, generator=g, dtype=dtype)
    adv[1] = 0.0
    mask = torch.ones(B, T, dtype=dtype)
    for b in range(B):
        mask[b, T - 1 - (b * 2) % T:] = 0  # varied lengths
    mask[:, 0] = 1
    weights = torch.where(torch.rand(B, T, generator=g) < 0.3, 1.3, 1.0).to(dtype)
    return new, old, adv, mask, weights


def reference_loss(new, old, adv, mask, weights, clip_low, clip_high, dual_clip, agg, norm_len=None):
    """Token-by-token loop in Python floats."""
    B, T = new.shape
    seq_sums, seq_lens, total = [], [], 0.0
    for b in range(B):
        s, n = 0.0, 0
        for t in range(T):
            if mask[b, t] == 0:
                continue
            A = float(adv[b])
            ratio = math.exp(max(-20.0, min(20.0, float(new[b, t] - old[b, t]))))
            l = max(-A * ratio, -A * min(max(ratio, 1 - clip_low), 1 + clip_high))
            if dual_clip is not None and A < 0:
                l = min(l, -A * dual_clip)
            l *= float(weights[b, t]) if weights is not None else 1.0
            s += l
            n += 1
        seq_sums.append(s)
        seq_lens.append(n)
        total += n
    if agg == "token-mean":
        return sum(seq_sums) / total
    if agg == "seq-mean-token-mean":
        return sum(s / max(n, 1) for s, n in zip(seq_sums, seq_lens)) / B
    return sum(seq_sums) / (B * (T if norm_len is None else norm_len))


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_matches_per_token_reference(agg, dual_clip):
    new, old, adv, mask, weights = make_batch()
    for w in (None, weights):
        loss, _ = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, weights=w, agg=agg)
        ref = reference_loss(new, old, adv, mask, w, 0.2, 0.28, dual_clip, agg)
        assert loss.item() == pytest.approx(ref, rel=1e-12, abs=1e-12)


def test_dual_clip_actually_binds_in_fixture():
    new, old, adv, mask, _ = make_batch()
    _, metrics = policy_loss(new, old, adv, mask, dual_clip=1.5)
    assert metrics["dual_clip_frac"].item() > 0


def test_metrics_against_counts():
    new, old, adv, mask, weights = make_batch(B=6, T=20, seed=3)
    _, metrics = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0, weights=weights)
    n = mask.sum().item()
    low = high = dual = 0
    kl = 0.0
    for b in range(6):
        A = adv[b].item()
        for t in range(20):
            if not mask[b, t]:
                continue
            lr = (new[b, t] - old[b, t]).item()
            r = math.exp(lr)
            low += A < 0 and r < 0.8
            high += A > 0 and r > 1.28
            dual += A < 0 and max(-A * r, -A * min(max(r, 0.8), 1.28)) > -A * 3.0
            kl += r - 1 - lr
    assert metrics["clip_frac_low"].item() == pytest.approx(low / n)
    assert metrics["clip_frac_high"].item() == pytest.approx(high / n)
    assert metrics["dual_clip_frac"].item() == pytest.approx(dual / n)
    assert metrics["approx_kl"].item() == pytest.approx(kl / n)
    assert metrics["weight_mean"].item() == pytest.approx((weights * mask).sum().item() / n)
    assert all(v.dim() == 0 for v in metrics.values())


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_micro_batches_with_global_counts_equal_full_batch(agg):
    new, old, adv, mask, weights = make_batch(B=7, T=11, seed=5)
    full_new = new.clone().requires_grad_(True)
    full, _ = policy_loss(full_new, old, adv, mask, weights=weights, agg=agg, dual_clip=3.0)
    full.backward()
    n_tok, n_seq = mask.sum(), 7
    acc_new = new.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 7)):
        part_mask = mask[rows]
        # a micro-batch padded to its own length must not matter either
        width = int(part_mask.sum(-1).max())
        loss, _ = policy_loss(acc_new[rows, :width], old[rows, :width], adv[rows], part_mask[:, :width],
                              weights=weights[rows, :width], agg=agg, dual_clip=3.0,
                              num_tokens=n_tok, num_seqs=n_seq, norm_len=11)
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(acc_new.grad, full_new.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_gradcheck(agg):
    new, old, adv, mask, weights = make_batch(B=3, T=5, seed=7)
    new = new.clone().requires_grad_(True)
    f = lambda x: policy_loss(x, old, adv, mask, weights=weights, agg=agg, clip_low=0.2, clip_high=0.28, dual_clip=2.0)[0]
    assert torch.autograd.gradcheck(f, (new,), eps=1e-7, atol=1e-7)


def test_weights_equal_scaled_advantages():
    # for w > 0: max(-wA r, -wA clip(r)) = w max(-A r, -A clip(r)); the same for the dual-clip min
    new, old, adv, mask, _ = make_batch(B=5, T=6, seed=11)
    w = torch.rand(5, 6, dtype=torch.float64) + 0.5
    a = adv[:, None].expand(5, 6)
    l1, _ = policy_loss(new, old, a, mask, weights=w, dual_clip=3.0)
    l2, _ = policy_loss(new, old, a * w, mask, dual_clip=3.0)
    assert l1.item() == pytest.approx(l2.item(), rel=1e-12)


def test_unit_weights_are_bit_identical_to_no_weights():
    new, old, adv, mask, _ = make_batch(dtype=torch.float32)
    for agg in AGGREGATIONS:
        a, _ = policy_loss(new, old, adv, mask, agg=agg, dual_clip=10.0)
        b, _ = policy_loss(new, old, adv, mask, agg=agg, dual_clip=10.0, weights=torch.ones_like(new))
        assert torch.equal(a, b)


def test_no_host_sync_on_meta_device():
    # meta tensors have no values: any .item(), bool() or data-dependent shape in the loss path raises
    B, T = 8, 4096
    new = torch.empty(B, T, device="meta", requires_grad=True)
    old = torch.empty(B, T, device="meta")
    adv = torch.empty(B, T, device="meta")
    mask = torch.empty(B, T, device="meta")
    weights = torch.empty(B, T, device="meta")
    for agg in AGGREGATIONS:
        loss, metrics = policy_loss(new, old, adv, mask, weights=weights, agg=agg, dual_clip=10.0,
                                    num_tokens=torch.empty((), device="meta"), num_seqs=B)
        assert loss.device.type == "meta" and loss.dim() == 0
        assert all(v.device.type == "meta" and v.dim() == 0 for v in metrics.values())
        loss.backward()


def test_nonfinite_and_bad_settings_raise():
    new, old, adv, mask, _ = make_batch()
    bad = new.clone()
    bad[0, 0], bad[0, 1] = float("nan"), float("inf")
    with pytest.raises(ValueError, match="logprobs holds 2 non-finite"):
        policy_loss(bad, old, adv, mask)
    bad_adv = adv.clone()
    bad_adv[2] = float("nan")
    with pytest.raises(ValueError, match="advantages holds"):
        policy_loss(new, old, bad_adv, mask)
    # NaN under padding is not the loss's business
    padded = new.clone()
    padded[mask == 0] = float("nan")
    padded.requires_grad_(True)
    loss, _ = policy_loss(padded, old, adv, mask, weights=torch.where(mask == 0, float("nan"), 1.0))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(padded.grad).all()
    assert loss.item() == pytest.approx(policy_loss(new, old, adv, mask)[0].item(), rel=1e-12)
    with pytest.raises(ValueError, match="unknown aggregation 'mean'; valid choices: token-mean"):
        policy_loss(new, old, adv, mask, agg="mean")
    with pytest.raises(ValueError, match="dual_clip must be in \\(1"):
        policy_loss(new, old, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(new, old, adv, mask, clip_low=-0.1)
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        policy_loss(new, old[:, :3], adv, mask)


# ---- penalty (KL-Cov) and clip=False -------------------------------------------------------------------------------
def _pre_change_loss(new, old, adv, mask, weights, clip_low, clip_high, dual_clip, agg):
    """policy_loss as it was before penalty/clip existed, written out: the defaults must reproduce it bit for bit."""
    valid = mask.bool()
    mask_f = mask.to(new.dtype)
    a = torch.where(valid, (adv[:, None] if adv.dim() == 1 else adv).expand_as(new).to(new.dtype), 0.0)
    log_ratio = torch.where(valid, new - old, 0.0).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    token = torch.maximum(-a * ratio, -a * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    if dual_clip is not None:
        token = torch.where(a < 0, torch.minimum(token, -a * dual_clip), token)
    lm = mask_f if weights is None else torch.where(valid, weights.to(token.dtype), 0.0)
    masked = token * lm
    if agg == "token-mean":
        return masked.sum() / mask_f.sum()
    if agg == "seq-mean-token-mean":
        return (masked.sum(dim=-1) / mask_f.sum(dim=-1).clamp(min=1.0)).sum() / new.shape[0]
    return masked.sum() / (new.shape[0] * new.shape[-1])


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_defaults_are_bit_identical_to_the_loss_before_penalty_and_clip(agg):
    for seed in range(4):
        new, old, adv, mask, weights = make_batch(B=5, T=13, seed=20 + seed, dtype=torch.float32)
        for w in (None, weights):
            for dual in (None, 3.0):
                x1 = new.clone().requires_grad_(True)
                x2 = new.clone().requires_grad_(True)
                x3 = new.clone().requires_grad_(True)
                got, _ = policy_loss(x1, old, adv, mask, weights=w, dual_clip=dual, agg=agg, clip_high=0.28)
                explicit, _ = policy_loss(x2, old, adv, mask, weights=w, dual_clip=dual, agg=agg, clip_high=0.28,
                                          penalty=None, clip=True)
                before = _pre_change_loss(x3, old, adv, mask, w, 0.2, 0.28, dual, agg)
                assert torch.equal(got, before) and torch.equal(explicit, before)
                for x, loss in ((x1, got), (x2, explicit), (x3, before)):
                    loss.backward()
                assert torch.equal(x1.grad, x3.grad) and torch.equal(x2.grad, x3.grad)


def reference_penalised(new, old, adv, mask, weights, penalty, clip, agg):
    """Per-token Python loop: (clipped or plain) surrogate times the weight, plus c |new - old|."""
    B, T = new.shape
    seq_sums, seq_lens = [], []
    for b in range(B):
        s, n = 0.0, 0
        for t in range(T):
            if mask[b, t] == 0:
                continue
            A = float(adv[b])
            d = float(new[b, t] - old[b, t])
            r = math.exp(d)
            l = max(-A * r, -A * min(max(r, 0.8), 1.2)) if clip else -A * r
            s += l * float(weights[b, t]) + float(penalty[b, t]) * abs(d)
            n += 1
        seq_sums.append(s)
        seq_lens.append(n)
    if agg == "token-mean":
        return sum(seq_sums) / sum(seq_lens)
    if agg == "seq-mean-token-mean":
        return sum(s / max(n, 1) for s, n in zip(seq_sums, seq_lens)) / B
    return sum(seq_sums) / (B * T)


def _penalty(new, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.where(torch.rand(new.shape, generator=g) < 0.4, 0.7, 0.0).to(new.dtype)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("clip", [True, False])
def test_penalty_and_unclipped_surrogate_against_reference(agg, clip):
    new, old, adv, mask, weights = make_batch(B=5, T=9, seed=31)
    c = _penalty(new)
    loss, metrics = policy_loss(new, old, adv, mask, weights=weights, penalty=c, clip=clip, agg=agg)
    assert loss.item() == pytest.approx(reference_penalised(new, old, adv, mask, weights, c, clip, agg), rel=1e-12)
    if not clip:  # nothing is held by a clip
        assert metrics["clip_frac_low"].item() == 0 and metrics["clip_frac_high"].item() == 0
    else:
        assert metrics["clip_frac_low"].item() + metrics["clip_frac_high"].item() > 0  # the fixture does clip


def test_unclipped_ignores_clip_ranges_and_dual_clip():
    new, old, adv, mask, weights = make_batch(B=6, T=10, seed=32)
    base, _ = policy_loss(new, old, adv, mask, clip=False)
    loss, metrics = policy_loss(new, old, adv, mask, clip=False, clip_low=0.01, clip_high=0.01, dual_clip=1.01)
    assert torch.equal(loss, base) and metrics["dual_clip_frac"].item() == 0
    ones = torch.ones_like(new)
    assert loss.item() == pytest.approx(reference_penalised(new, old, adv, mask, ones, 0 * ones, False, "token-mean"),
                                        rel=1e-12)
    assert policy_loss(new, old, adv, mask, dual_clip=1.01)[1]["dual_clip_frac"].item() > 0  # it binds when clipping


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_penalty_gradients(agg):
    new, old, adv, mask, weights = make_batch(B=4, T=7, seed=33)
    c = _penalty(new, seed=1)
    x = new.clone().requires_grad_(True)
    loss, _ = policy_loss(x, old, adv, mask, weights=weights, penalty=c, clip=False, agg=agg)
    loss.backward()
    # an independent expression of the same loss, differentiated by autograd
    y = new.clone().requires_grad_(True)
    a = adv[:, None]
    per_token = (-a * torch.exp(y - old) * weights + c * (y - old).abs()) * mask
    if agg == "token-mean":
        ref = per_token.sum() / mask.sum()
    elif agg == "seq-mean-token-mean":
        ref = (per_token.sum(-1) / mask.sum(-1)).mean()
    else:
        ref = per_token.sum() / (4 * 7)
    ref.backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-15)
    # and by hand for token-mean: d/dx = (-A r w + c sign(x - old)) / N on response tokens
    if agg == "token-mean":
        hand = (-a * torch.exp(new - old) * weights + c * torch.sign(new - old)) * mask / mask.sum()
        torch.testing.assert_close(x.grad, hand, rtol=1e-12, atol=1e-15)
    # finite differences (no token sits at new == old, where |.| has a kink)
    f = lambda z: policy_loss(z, old, adv, mask, weights=weights, penalty=c, clip=False, agg=agg)[0]
    assert torch.autograd.gradcheck(f, (new.clone().requires_grad_(True),), eps=1e-7, atol=1e-7)
    g = lambda z: policy_loss(z, old, adv, mask, weights=weights, penalty=c, clip=True, dual_clip=2.0, agg=agg)[0]
    assert torch.autograd.gradcheck(g, (new.clone().requires_grad_(True),), eps=1e-7, atol=1e-7)


def test_penalty_at_ratio_one_has_no_gradient_and_padding_cannot_leak():
    new, old, adv, mask, weights = make_batch(B=3, T=6, seed=34)
    x = old.clone().requires_grad_(True)  # the first update of a step: new == old
    c = torch.ones_like(old)
    with_pen, _ = policy_loss(x, old, adv, mask, penalty=c, clip=False)
    with_pen.backward()
    y = old.clone().requires_grad_(True)
    without, _ = policy_loss(y, old, adv, mask, clip=False)
    without.backward()
    assert torch.equal(with_pen, without) and torch.equal(x.grad, y.grad)
    padded = new.clone()
    padded[mask == 0] = float("nan")
    padded.requires_grad_(True)
    pen = torch.where(mask == 0, float("nan"), _penalty(new))
    loss, _ = policy_loss(padded, old, adv, mask, penalty=pen, clip=False)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(padded.grad).all()
    assert loss.item() == pytest.approx(policy_loss(new, old, adv, mask, penalty=_penalty(new), clip=False)[0].item(),
                                        rel=1e-12)


def test_penalty_is_checked_and_costs_no_host_sync():
    new, old, adv, mask, _ = make_batch()
    with pytest.raises(ValueError, match="penalty has shape"):
        policy_loss(new, old, adv, mask, penalty=torch.ones(2, 2, dtype=new.dtype))
    with pytest.raises(ValueError, match="penalty holds negative"):
        policy_loss(new, old, adv, mask, penalty=-torch.ones_like(new))
    bad = torch.ones_like(new)
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="penalty holds 1 non-finite"):
        policy_loss(new, old, adv, mask, penalty=bad)
    # clip_low = 1 (Clip-Cov's scripts: no clip below) is allowed, 1.5 is not
    policy_loss(new, old, adv, mask, clip_low=1.0, clip_high=1.0)
    with pytest.raises(ValueError, match="clip_low must be in \\[0, 1\\], got 1.5"):
        policy_loss(new, old, adv, mask, clip_low=1.5)
    B, T = 4, 1024
    meta = dict(device="meta")
    x = torch.empty(B, T, requires_grad=True, **meta)
    for agg in AGGREGATIONS:
        loss, metrics = policy_loss(x, torch.empty(B, T, **meta), torch.empty(B, T, **meta), torch.empty(B, T, **meta),
                                    weights=torch.empty(B, T, **meta), penalty=torch.empty(B, T, **meta), clip=False,
                                    agg=agg, num_tokens=torch.empty((), **meta), num_seqs=B)
        assert loss.device.type == "meta" and all(v.device.type == "meta" for v in metrics.values())
        loss.backward()
