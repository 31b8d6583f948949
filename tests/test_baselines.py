"""The entropy baselines' token rules (Clip-Cov, KL-Cov, 80/20) against brute force written out here.

Every rule is re-implemented over a Python list of the response tokens: means as Python sums, selections by
sorting the list, counts with exact fractions. Log-probs and advantages sit on coarse dyadic grids, so the sums are
exact and many tokens tie (at the selection thresholds too); the code keeps the covariance in float32, so the brute
force rounds its float64 covariance to float32 before comparing (rounding is monotone: it can merge ties, never
reorder). The two-process test runs real gloo collectives and checks the union of both ranks' tokens.
"""
from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
import torch

from stare.algorithms._plain import STEER_MAPPINGS
from stare.algorithms.baselines import steer_weights
from stare.algorithms import (
    EntropyStats,
    clip_cov_weights,
    entropy_top_weights,
    floor_count,
    get_algorithm,
    kl_cov_coefs,
    policy_loss,
    stare_step,
    token_covariance,
)


# ---- a batch and the brute force -------------------------------------------------------------------------------
def _batch(B=7, T=10, seed=0, per_token=False, empty_rows=(2,)):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    for r in empty_rows:  # all-padding rows
        mask[r] = False
    logp = -torch.randint(0, 24, (B, T), generator=g).float() / 8  # multiples of 1/8 in [-2.875, 0]
    adv_seq = torch.randint(-6, 7, (B,), generator=g).float() / 4  # multiples of 1/4, ties and zeros
    adv = adv_seq[:, None] * (torch.randint(1, 4, (B, T), generator=g).float() / 2) if per_token else adv_seq
    entropy = torch.randint(0, 15, (B, T), generator=g).float() / 10  # ties at the threshold
    logp[~mask] = float("nan")  # padding may hold anything
    entropy[~mask] = float("nan")
    return logp, adv, mask, entropy


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).to(torch.float32))


def _tokens(logp, adv, mask, entropy=None):
    B, T = logp.shape
    adv_tok = adv[:, None].expand(B, T) if adv.dim() == 1 else adv
    out = []
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                out.append({"pos": (i, t), "lp": float(logp[i, t]), "a": float(adv_tok[i, t]),
                            "h": None if entropy is None else float(entropy[i, t])})
    if out:
        n = len(out)
        mean_a = sum(t["a"] for t in out) / n
        mean_lp = sum(t["lp"] for t in out) / n
        for t in out:
            t["cov"] = _f32((t["a"] - mean_a) * (t["lp"] - mean_lp))
    return out


def _floor_k(ratio, n):
    return 0 if n == 0 else min(n, max(1, math.floor(Fraction(str(ratio)) * n)))


def _ceil_k(ratio, n):
    if n == 0 or ratio == 0:
        return 0
    return min(n, max(1, math.ceil(Fraction(str(ratio)) * n)))


def _threshold_set(toks, key, k):
    """Tokens whose key is at or above the k-th largest (ties at the threshold all in)."""
    if k == 0:
        return []
    threshold = sorted((key(t) for t in toks), reverse=True)[k - 1]
    return [t for t in toks if key(t) >= threshold]


def _brute_kl_cov(logp, adv, mask, k_ratio, kl_coef):
    toks = _tokens(logp, adv, mask)
    out = torch.zeros(logp.shape)
    for t in _threshold_set(toks, lambda t: t["cov"], _floor_k(k_ratio, len(toks))):
        out[t["pos"]] = kl_coef
    return out


def _brute_candidates(logp, adv, mask, low, high):
    return [t for t in _tokens(logp, adv, mask) if low < t["cov"] < high]


def _brute_clip_cov(logp, adv, mask, keys, ratio, low, high):
    """Dropped: the k candidates with the largest keys, equal keys in row-major order (sorted is stable)."""
    n = int(mask.sum())
    cand = _brute_candidates(logp, adv, mask, low, high)
    k = min(len(cand), _floor_k(ratio, n))
    out = torch.ones(logp.shape)
    for t in sorted(cand, key=lambda t: -float(keys[t["pos"]]))[:k]:
        out[t["pos"]] = 0.0
    return out


def _brute_80_20(entropy, mask, ratio, denominator="all"):
    toks = _tokens(entropy, torch.zeros(entropy.shape[0]), mask, entropy)
    out = torch.ones(entropy.shape)
    kept = {t["pos"] for t in _threshold_set(toks, lambda t: t["h"], _ceil_k(ratio, len(toks)))}
    for t in toks:
        if t["pos"] not in kept:
            out[t["pos"]] = 0.0
        elif denominator == "selected":
            out[t["pos"]] = len(toks) / len(kept)
    return out


# ---- the covariance and the counts -----------------------------------------------------------------------------
@pytest.mark.parametrize("per_token", [False, True])
def test_covariance_is_the_centred_product_over_the_response_tokens(per_token):
    logp, adv, mask, _ = _batch(per_token=per_token)
    cov = token_covariance(logp, adv, mask)
    assert cov.dtype == torch.float32 and cov[~mask].eq(0).all()
    for t in _tokens(logp, adv, mask):
        assert float(cov[t["pos"]]) == t["cov"], t["pos"]
    # a second formula: the mean of the per-token terms is the batch covariance E[A logp] - E[A] E[logp]
    toks = _tokens(logp, adv, mask)
    n = len(toks)
    second = sum(t["a"] * t["lp"] for t in toks) / n - sum(t["a"] for t in toks) * sum(t["lp"] for t in toks) / n ** 2
    assert float(cov[mask].double().mean()) == pytest.approx(second, rel=1e-6, abs=1e-7)
    # per-sequence advantages give exactly what the same advantages broadcast per token give
    if not per_token:
        assert torch.equal(cov, token_covariance(logp, adv[:, None].expand_as(logp).clone(), mask))


def test_floor_count():
    assert [floor_count(2e-3, n) for n in (0, 1, 499, 500, 1499, 1500, 5000)] == [0, 1, 1, 1, 2, 3, 10]
    assert floor_count(0.1, 30) == 3 and floor_count(0.29, 100) == 29 and floor_count(1.0, 7) == 7
    for n in range(1, 400):
        for ratio in (2e-4, 2e-3, 0.07, 0.1, 0.3):
            assert floor_count(ratio, n) == _floor_k(ratio, n), (ratio, n)


# ---- KL-Cov --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed, per_token, k_ratio", [(0, False, 0.1), (1, True, 0.1), (2, False, 0.3),
                                                      (3, True, 2e-3), (4, False, 1.0)])
def test_kl_cov_is_the_top_share_by_covariance(seed, per_token, k_ratio):
    logp, adv, mask, _ = _batch(seed=seed, per_token=per_token)
    got = kl_cov_coefs(logp, adv, mask, k_ratio=k_ratio, kl_coef=0.7)
    expected = _brute_kl_cov(logp, adv, mask, k_ratio, 0.7)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert int((got > 0).sum()) >= _floor_k(k_ratio, int(mask.sum()))


def test_kl_cov_keeps_every_tie_at_the_threshold():
    mask = torch.ones(2, 4, dtype=torch.bool)
    logp = torch.tensor([[-1.0, -1.0, -2.0, -3.0], [-1.0, -2.0, -2.0, -3.0]])
    adv = torch.tensor([1.0, -1.0])
    # cov: row 0 (A - 0 = 1) * (logp + 15/8); row 1 the negation. Largest: row 0's two -1.0 tokens (7/8) and row 1's
    # -3.0 token (9/8). k = floor(0.25 * 8) = 2 -> threshold 7/8, both row-0 ties selected as well: 3 tokens.
    got = kl_cov_coefs(logp, adv, mask, k_ratio=0.25, kl_coef=1.0)
    assert got.tolist() == [[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]]


def test_kl_cov_edge_cases():
    logp, adv, mask, _ = _batch()
    none = torch.zeros_like(mask)
    assert torch.equal(kl_cov_coefs(logp, adv, none), torch.zeros(logp.shape))  # all padding: nothing selected
    one = torch.zeros_like(mask)
    one[0, 0] = True
    assert kl_cov_coefs(logp, adv, one, k_ratio=2e-3).tolist()[0][0] == 1.0  # at least one token
    assert torch.equal(kl_cov_coefs(logp, adv, mask, kl_coef=0.0), torch.zeros(logp.shape))
    with pytest.raises(ValueError, match="k_ratio must be in \\(0, 1\\], got 0"):
        kl_cov_coefs(logp, adv, mask, k_ratio=0)
    with pytest.raises(ValueError, match="kl_coef must be in \\[0, inf\\], got -0.5"):
        kl_cov_coefs(logp, adv, mask, kl_coef=-0.5)
    bad = logp.clone()
    bad[tuple(mask.nonzero()[0].tolist())] = float("inf")
    with pytest.raises(ValueError, match="logprobs holds 1 non-finite"):
        kl_cov_coefs(bad, adv, mask)


# ---- Clip-Cov ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed, per_token, ratio, low, high", [
    (0, False, 0.1, 0.0, 0.8), (1, True, 0.1, -0.2, 0.5), (2, False, 0.3, 0.05, 2.0), (3, True, 2e-4, 0.0, 5.0),
])
def test_clip_cov_with_fixed_keys_is_the_brute_force(seed, per_token, ratio, low, high):
    logp, adv, mask, _ = _batch(seed=seed, per_token=per_token)
    keys = torch.rand(logp.shape, generator=torch.Generator().manual_seed(seed + 100))
    got = clip_cov_weights(logp, adv, mask, clip_ratio=ratio, cov_low=low, cov_high=high, keys=keys)
    expected = _brute_clip_cov(logp, adv, mask, keys, ratio, low, high)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    cand = _brute_candidates(logp, adv, mask, low, high)
    assert cand and int((got == 0).sum()) == min(len(cand), _floor_k(ratio, int(mask.sum())))


def test_clip_cov_tied_keys_keep_the_count_exact():
    logp, adv, mask, _ = _batch(seed=5)
    keys = torch.full(logp.shape, 0.5)  # every key tied: the first k candidates in row-major order
    got = clip_cov_weights(logp, adv, mask, clip_ratio=0.1, cov_low=-1.0, cov_high=1.0, keys=keys)
    assert torch.equal(got, _brute_clip_cov(logp, adv, mask, keys, 0.1, -1.0, 1.0))
    assert int((got == 0).sum()) == _floor_k(0.1, int(mask.sum()))


def test_clip_cov_candidates_are_strictly_inside_the_band():
    mask = torch.ones(2, 4, dtype=torch.bool)
    logp = torch.tensor([[-1.0, -1.0, -2.0, -3.0], [-1.0, -2.0, -2.0, -3.0]])
    adv = torch.tensor([1.0, -1.0])  # covariances: 7/8, 7/8, -1/8, -9/8 | -7/8, 1/8, 1/8, 9/8
    got = clip_cov_weights(logp, adv, mask, clip_ratio=1.0, cov_low=0.125, cov_high=1.125, keys=torch.rand(2, 4))
    assert got.tolist() == [[0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]  # 1/8 and 9/8 are on the edges: out


def test_clip_cov_edge_cases():
    logp, adv, mask, _ = _batch()
    ones = torch.ones(logp.shape)
    assert torch.equal(clip_cov_weights(logp, adv, torch.zeros_like(mask)), ones)  # all padding
    assert torch.equal(clip_cov_weights(logp, adv, mask, cov_low=50.0, cov_high=60.0), ones)  # no candidate
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    clip_cov_weights(logp, adv, mask, cov_low=50.0, cov_high=60.0, generator=g)
    assert torch.equal(g.get_state(), state)  # nothing to choose: no draw
    with pytest.raises(ValueError, match="clip_ratio must be in \\(0, 1\\], got 0"):
        clip_cov_weights(logp, adv, mask, clip_ratio=0)
    with pytest.raises(ValueError, match="cov_high must be in \\(1.0, inf\\], got 1.0"):
        clip_cov_weights(logp, adv, mask, cov_low=1.0, cov_high=1.0)
    with pytest.raises(ValueError, match="keys has shape"):
        clip_cov_weights(logp, adv, mask, keys=torch.rand(3, 3))


def test_clip_cov_randomness_seeded_exact_and_uniform():
    logp, adv, mask, _ = _batch(seed=6, B=8, T=12)
    low, high, ratio = 0.0, 0.6, 0.05
    cand = {t["pos"] for t in _brute_candidates(logp, adv, mask, low, high)}
    k = min(len(cand), _floor_k(ratio, int(mask.sum())))
    assert len(cand) >= 3 * k >= 6  # a real choice

    def run(seed):
        return clip_cov_weights(logp, adv, mask, clip_ratio=ratio, cov_low=low, cov_high=high,
                                generator=torch.Generator().manual_seed(seed))

    assert torch.equal(run(7), run(7))  # same seed, same selection
    counts = dict.fromkeys(cand, 0)
    draws = 3000
    distinct = set()
    for seed in range(draws):
        dropped = {tuple(p) for p in (run(seed) == 0).nonzero().tolist()}
        assert len(dropped) == k and dropped <= cand, seed
        distinct.add(frozenset(dropped))
        for p in dropped:
            counts[p] += 1
    p = k / len(cand)
    sd = math.sqrt(draws * p * (1 - p))
    for pos, c in counts.items():  # every candidate chosen about draws * k / |cand| times (5 sd)
        assert abs(c - draws * p) < 5 * sd, (pos, c, draws * p)
    assert len(distinct) > draws // 4  # many different subsets, not a few repeated ones


# ---- 80/20 ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed, ratio", [(0, 0.2), (1, 0.2), (2, 0.5), (3, 0.01), (4, 1.0)])
def test_80_20_keeps_the_top_share_by_entropy(seed, ratio):
    _, _, mask, entropy = _batch(seed=seed)
    got = entropy_top_weights(entropy, mask, top_ratio=ratio)
    expected = _brute_80_20(entropy, mask, ratio)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert got[~mask].eq(1).all() and int(got[mask].sum()) >= _ceil_k(ratio, int(mask.sum()))
    sel = entropy_top_weights(entropy, mask, top_ratio=ratio, denominator="selected")
    assert torch.allclose(sel, _brute_80_20(entropy, mask, ratio, "selected"), rtol=1e-6, atol=0)
    assert torch.equal(sel == 0, got == 0)  # the same tokens kept; only their weight differs


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_80_20_selected_denominator_is_the_mean_over_the_selected_tokens(agg):
    """The loss with denominator "selected", by hand: token-mean sums the kept tokens' losses and divides by their
    count S (the 80/20 paper's code); "all" divides the same sum by every response token N (TRL's, and what this
    project did before)."""
    logp, adv, mask, entropy = _batch(seed=5, B=6, T=10, per_token=True)
    old = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    kept = entropy_top_weights(entropy, mask, top_ratio=0.2) == 1
    toks = [(b, t) for b in range(logp.shape[0]) for t in range(logp.shape[1]) if mask[b, t]]

    def token_loss(b, t):  # the clipped surrogate of one token, as section 2 of docs/algorithm.md writes it
        r = math.exp(float(logp[b, t] - old[b, t]))
        a = float(adv[b, t])
        return max(-a * r, -a * min(max(r, 0.8), 1.28))

    n, s_count = len(toks), sum(bool(kept[p]) for p in toks)
    if agg == "token-mean":
        by_hand = {"selected": sum(token_loss(*p) for p in toks if kept[p]) / s_count}
        by_hand["all"] = by_hand["selected"] * s_count / n
    else:  # each sequence's mean over its tokens, the kept ones weighted N / S, then the mean over sequences
        def seq_mean(scale):
            rows = [[p for p in toks if p[0] == b] for b in range(logp.shape[0])]
            return sum(sum(token_loss(*p) * scale for p in row if kept[p]) / len(row) for row in rows if row) / len(
                [row for row in rows if row])
        by_hand = {"selected": seq_mean(n / s_count), "all": seq_mean(1.0)}
    for denominator in ("selected", "all"):
        w = entropy_top_weights(entropy, mask, top_ratio=0.2, denominator=denominator)
        loss, _ = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, weights=w, agg=agg,
                              num_seqs=int(mask.any(-1).sum()))
        assert float(loss) == pytest.approx(by_hand[denominator], rel=1e-5), denominator
    assert by_hand["selected"] != pytest.approx(by_hand["all"])


def test_80_20_edge_cases():
    _, _, mask, entropy = _batch()
    assert torch.equal(entropy_top_weights(entropy, torch.zeros_like(mask)), torch.ones(mask.shape))
    zero = entropy_top_weights(entropy, mask, top_ratio=0.0)  # nothing kept: no gradient at all
    assert zero[mask].eq(0).all() and zero[~mask].eq(1).all()
    flat = torch.ones(mask.shape)
    assert torch.equal(entropy_top_weights(flat, mask), torch.ones(mask.shape))  # every token tied: all kept
    with pytest.raises(ValueError, match="top_ratio must be in \\[0, 1\\], got 1.5"):
        entropy_top_weights(entropy, mask, top_ratio=1.5)


# ---- through stare_step ----------------------------------------------------------------------------------------
def _stats(logp, entropy, mask, seed=0):
    phi = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed))
    return EntropyStats(torch.where(mask, entropy, 0.0), -torch.where(mask, logp, 0.0), phi)


@pytest.mark.parametrize("scope", ["global", "micro_batch"])
def test_stare_step_runs_each_rule_once_over_the_batch(scope):
    logp, adv, mask, entropy = _batch(seed=8, B=8, T=12)
    stats = _stats(logp, entropy, mask)
    parts = [torch.arange(0, 3), torch.arange(3, 8)]
    kl = get_algorithm("kl-cov", k_ratio=0.1, kl_cov_coef=0.5, scope=scope)
    r = stare_step(None, kl, logp, adv, mask, stats, micro_batches=parts)
    assert r.weights is None and torch.equal(r.penalty, _brute_kl_cov(logp, adv, mask, 0.1, 0.5))
    top = get_algorithm("80-20", top_ratio=0.3, scope=scope)  # mask_denominator "selected", the registry's
    r = stare_step(None, top, logp, adv, mask, stats, micro_batches=parts)
    assert r.penalty is None and torch.allclose(r.weights, _brute_80_20(entropy, mask, 0.3, "selected"), rtol=1e-6)
    r = stare_step(None, get_algorithm("80-20", top_ratio=0.3, scope=scope, mask_denominator="all"), logp, adv, mask,
                   stats, micro_batches=parts)
    assert r.penalty is None and torch.equal(r.weights, _brute_80_20(entropy, mask, 0.3))
    clip = get_algorithm("clip-cov", clip_ratio=0.1, cov_low=0.0, cov_high=0.8, scope=scope)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    r = stare_step(None, clip, logp, adv, mask, stats, micro_batches=parts, generator=g1)
    keys = torch.rand(logp.shape, generator=g2)  # the keys the rule draws from the step's generator
    assert r.penalty is None and torch.equal(r.weights, _brute_clip_cov(logp, adv, mask, keys, 0.1, 0.0, 0.8))


def test_stare_step_telemetry_of_the_rules():
    logp, adv, mask, entropy = _batch(seed=9, B=8, T=12)
    stats = _stats(logp, entropy, mask, seed=1)
    toks = _tokens(logp, adv, mask, entropy)
    phi = {t["pos"]: float(stats.phi[t["pos"]]) for t in toks}
    n = len(toks)

    def share(sel):
        return sum(phi[p] > 0 for p in sel) / len(sel)

    r = stare_step(None, get_algorithm("kl-cov", k_ratio=0.1), logp, adv, mask, stats)
    pen = [t["pos"] for t in toks if r.penalty[t["pos"]] > 0]
    m = r.metrics
    assert m["stare/penalised_share"] == pytest.approx(len(pen) / n)
    assert m["stare/lowered_phi_pos_share"] == pytest.approx(share(pen))
    assert m["stare/masked_share"] == 0.0 and m["stare/mean_weight"] == 1.0
    assert "stare/boosted_phi_pos_share" not in m
    assert m["stare/entropy_forecast"] == m["stare/entropy_forecast_base"]  # |logp - old| has no first-order push

    for denominator in ("all", "selected"):
        r = stare_step(None, get_algorithm("80-20", mask_denominator=denominator), logp, adv, mask, stats)
        dropped = [t["pos"] for t in toks if r.weights[t["pos"]] == 0]
        keep = 1.0 if denominator == "all" else n / (n - len(dropped))  # the kept tokens' weight
        m = r.metrics
        assert m["stare/masked_share"] == pytest.approx(len(dropped) / n)
        assert m["stare/lowered_phi_pos_share"] == pytest.approx(share(dropped))
        assert m["stare/mean_weight"] == pytest.approx(keep * (1 - len(dropped) / n))
        assert "stare/penalised_share" not in m and "stare/boosted_phi_pos_share" not in m
        adv_tok = {t["pos"]: t["a"] for t in toks}
        kept_sum = sum(adv_tok[p] * phi[p] for p in phi if r.weights[p] != 0)
        assert m["stare/entropy_forecast"] == pytest.approx(keep * kept_sum / n, rel=1e-5, abs=1e-7)

    # telemetry off: the rule still runs; without the entropy (not needed) only the token count is logged
    off = get_algorithm("clip-cov", telemetry="off", clip_ratio=0.1, cov_low=0.0, cov_high=0.8)
    assert not off.needs_entropy
    r = stare_step(None, off, logp, adv, mask, EntropyStats(None, -logp, None), generator=torch.Generator())
    assert r.metrics == {"stare/tokens": float(n)} and int((r.weights == 0).sum()) == _floor_k(0.1, n)
    with pytest.raises(ValueError, match="stats.entropy is None, but '80-20'"):
        stare_step(None, get_algorithm("80-20", telemetry="off"), logp, adv, mask, EntropyStats(None, -logp, None))


# ---- two processes, real collectives -------------------------------------------------------------------------
ROWS = (slice(0, 3), slice(3, 8))  # uneven shares; row 2 is all padding


def _rank_main(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    group = dist.group.WORLD
    try:
        out = {}
        rows = ROWS[rank]
        for case, per_token in enumerate((False, True)):
            logp, adv, mask, entropy = _batch(seed=10 + case, B=8, T=12, per_token=per_token)
            keys = torch.rand(logp.shape, generator=torch.Generator().manual_seed(case))
            shard = (logp[rows], adv[rows], mask[rows])
            out[f"cov{case}"] = token_covariance(*shard, group=group)
            out[f"kl{case}"] = kl_cov_coefs(*shard, k_ratio=0.1, kl_coef=0.5, group=group)
            out[f"clip{case}"] = clip_cov_weights(*shard, clip_ratio=0.1, cov_low=0.0, cov_high=0.8,
                                                  keys=keys[rows], group=group)
            tied = torch.full(logp.shape, 0.25)[rows]  # tied keys: the count stays exact across ranks
            out[f"clip_tied{case}"] = clip_cov_weights(*shard, clip_ratio=0.1, cov_low=-1.0, cov_high=1.0,
                                                       keys=tied, group=group)
            out[f"top{case}"] = entropy_top_weights(entropy[rows], mask[rows], top_ratio=0.2, group=group)
            for mapping in STEER_MAPPINGS:  # the batch's max (and min) |Omega| over both ranks
                out[f"steer_{mapping}{case}"] = steer_weights(logp[rows], adv[rows], entropy[rows], mask[rows],
                                                              mapping=mapping, group=group)
            stats = _stats(logp, entropy, mask, seed=case)
            stats = EntropyStats(*(x[rows] for x in stats))
            cfg = get_algorithm("clip-cov", clip_ratio=0.1, cov_low=0.0, cov_high=0.8)
            step = stare_step(None, cfg, *shard, stats, group=group,
                              generator=torch.Generator().manual_seed(1000 + rank))
            out[f"step_clip{case}"] = (step.weights, step.metrics)
            step = stare_step(None, get_algorithm("kl-cov", k_ratio=0.1), *shard, stats, group=group)
            out[f"step_kl{case}"] = (step.penalty, step.metrics)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.cpu_only  # the ranks are CPU processes over gloo; their batch comes from the CPU generator
def test_two_ranks_equal_one_process_on_the_union(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]

    def joined(key):
        return torch.cat([p[key] for p in parts])

    for case, per_token in enumerate((False, True)):
        logp, adv, mask, entropy = _batch(seed=10 + case, B=8, T=12, per_token=per_token)
        keys = torch.rand(logp.shape, generator=torch.Generator().manual_seed(case))
        assert torch.equal(joined(f"cov{case}"), token_covariance(logp, adv, mask))
        for mapping in STEER_MAPPINGS:
            whole = steer_weights(logp, adv, entropy, mask, mapping=mapping)
            assert torch.equal(joined(f"steer_{mapping}{case}"), whole)
            assert not torch.equal(parts[0][f"steer_{mapping}{case}"],  # a rank alone would weigh otherwise
                                   steer_weights(logp[ROWS[0]], adv[ROWS[0]], entropy[ROWS[0]], mask[ROWS[0]],
                                                 mapping=mapping))
        assert torch.equal(joined(f"kl{case}"), _brute_kl_cov(logp, adv, mask, 0.1, 0.5))
        assert torch.equal(joined(f"clip{case}"), _brute_clip_cov(logp, adv, mask, keys, 0.1, 0.0, 0.8))
        tied = torch.full(logp.shape, 0.25)
        assert torch.equal(joined(f"clip_tied{case}"), _brute_clip_cov(logp, adv, mask, tied, 0.1, -1.0, 1.0))
        assert torch.equal(joined(f"top{case}"), _brute_80_20(entropy, mask, 0.2))
        # stare_step over two ranks: clip-cov's count and candidacy are exact over the union, the metrics agree
        weights = torch.cat([p[f"step_clip{case}"][0] for p in parts])
        cand = {t["pos"] for t in _brute_candidates(logp, adv, mask, 0.0, 0.8)}
        dropped = {tuple(p) for p in (weights == 0).nonzero().tolist()}
        assert len(dropped) == min(len(cand), _floor_k(0.1, int(mask.sum()))) and dropped <= cand
        assert parts[0][f"step_clip{case}"][1] == parts[1][f"step_clip{case}"][1]
        assert parts[0][f"step_clip{case}"][1]["stare/masked_share"] == pytest.approx(len(dropped) / int(mask.sum()))
        penalty = torch.cat([p[f"step_kl{case}"][0] for p in parts])
        assert torch.equal(penalty, _brute_kl_cov(logp, adv, mask, 0.1, 1.0))
        one = stare_step(None, get_algorithm("kl-cov", k_ratio=0.1), logp, adv, mask, _stats(logp, entropy, mask, case))
        for key, value in one.metrics.items():
            assert parts[0][f"step_kl{case}"][1][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
