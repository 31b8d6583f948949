"""stare_token_weights against a brute-force re-implementation of the rules, layout independence, gloo."""
import math
import os
import socket
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stare.algorithms import kth_largest, policy_loss, stare_token_weights, top_count
from stare.algorithms.selection import _key_to_float, _ordered_keys


def brute_force_paper(logprobs, adv, mask, P, W, M, variant):
    """The paper's rule, written with Python lists and exact fractions."""
    B, T = logprobs.shape
    adv = adv[:, None].expand(B, T) if adv.dim() == 1 else adv
    weights = [[1.0] * T for _ in range(B)]
    for sign, value, enabled in ((1, W, True), (-1, M, variant == "C2")):
        if not enabled:
            continue
        members = [(-float(logprobs[b, t]), b, t) for b in range(B) for t in range(T)
                   if mask[b, t] and (adv[b, t] > 0 if sign > 0 else adv[b, t] < 0)]
        if not members or P == 0:
            continue
        k = max(1, math.ceil(Fraction(str(P)) * len(members)))
        ranked = sorted((s for s, _, _ in members), reverse=True)
        threshold = ranked[k - 1]
        for s, b, t in members:
            if s >= threshold:
                weights[b][t] = value
    return torch.tensor(weights)


def random_batch(B=12, T=30, seed=0, ties=False, device=None):
    """``device=None``: the test device (``--device cuda`` puts it on the GPU, from the GPU's generator)."""
    on = {} if device is None else {"device": device}
    g = torch.Generator(**on).manual_seed(seed)
    logprobs = -torch.rand(B, T, generator=g, **on) * 4
    if ties:
        logprobs = (logprobs * 4).round() / 4  # many exact ties
    adv = torch.randn(B, generator=g, **on)
    adv[::5] = 0.0
    mask = torch.ones(B, T, **on)
    lengths = torch.randint(1, T + 1, (B,), generator=g, **on)
    for b in range(B):
        mask[b, lengths[b]:] = 0
    return logprobs, adv, mask


def test_top_count_is_exact_ceil():
    for n in range(0, 400):
        for P in (0.1, 0.2, 0.3, 0.05, 1.0, 0.7):
            expected = 0 if n == 0 else max(1, math.ceil(Fraction(str(P)) * n))
            assert top_count(P, n) == expected, (P, n)
    assert top_count(0.1, 30) == 3  # naive float ceil gives 4
    assert top_count(0.0, 30) == 0


@pytest.mark.parametrize("variant", ["O1", "C2"])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("P", [0.1, 0.25, 1.0])
def test_paper_rule_matches_brute_force(variant, ties, P):
    for seed in range(5):
        logprobs, adv, mask = random_batch(seed=seed, ties=ties)
        # per-sequence advantages (the row-gather path) and per-token ones (the mask path)
        per_token = adv[:, None] * torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(seed)).sign()
        for a in (adv, adv[:, None].expand_as(logprobs), per_token):
            got = stare_token_weights(logprobs, a, mask, top_ratio=P, w=1.1, m=0.9, variant=variant)
            want = brute_force_paper(logprobs, a, mask, P, 1.1, 0.9, variant)
            assert torch.equal(got, want)


def test_gate_off_is_exactly_the_base_loss():
    logprobs, adv, mask = random_batch(seed=3)
    new = logprobs + 0.1 * torch.randn_like(logprobs)
    weights = stare_token_weights(logprobs, adv, mask, gate_on=False, variant="C2", w=2.0, m=0.5)
    assert torch.equal(weights, torch.ones_like(weights))
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        base, _ = policy_loss(new, logprobs, adv, mask, agg=agg, dual_clip=10.0, clip_high=0.28)
        gated, _ = policy_loss(new, logprobs, adv, mask, agg=agg, dual_clip=10.0, clip_high=0.28, weights=weights)
        assert torch.equal(base, gated)


def test_selection_does_not_depend_on_layout():
    logprobs, adv, mask = random_batch(B=16, T=25, seed=4)
    ref = stare_token_weights(logprobs, adv, mask, variant="C2")
    # rows in another order
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    permuted = stare_token_weights(logprobs[perm], adv[perm], mask[perm], variant="C2")
    assert torch.equal(permuted, ref[perm])
    # more padding, holding garbage log-probs
    wide_lp = torch.cat([logprobs, torch.full((16, 9), -0.001)], dim=1)
    wide_mask = torch.cat([mask, torch.zeros(16, 9)], dim=1)
    wide = stare_token_weights(wide_lp, adv, wide_mask, variant="C2")
    assert torch.equal(wide[:, :25], ref) and torch.equal(wide[:, 25:], torch.ones(16, 9))
    # the reference's per-micro-batch rule is not layout independent: same data, other split, other weights
    per_mb_4 = stare_token_weights(logprobs, adv, mask, variant="C2", micro_batch_size=4)
    per_mb_8 = stare_token_weights(logprobs, adv, mask, variant="C2", micro_batch_size=8)
    assert not torch.equal(per_mb_4, per_mb_8)
    assert not torch.equal(per_mb_4, ref)


def test_per_micro_batch_option_matches_brute_force_per_block():
    logprobs, adv, mask = random_batch(B=10, T=20, seed=6)
    got = stare_token_weights(logprobs, adv, mask, variant="C2", micro_batch_size=3)
    want = torch.cat([brute_force_paper(logprobs[i:i + 3], adv[i:i + 3], mask[i:i + 3], 0.1, 1.1, 0.9, "C2")
                      for i in range(0, 10, 3)])
    assert torch.equal(got, want)


def test_phi_rule_damping_cap_and_mirror():
    g = torch.Generator().manual_seed(7)
    B, T = 8, 20
    logprobs, adv, mask = random_batch(B, T, seed=7)
    phi = torch.randn(B, T, generator=g)
    A = adv[:, None].expand(B, T)
    valid = mask.bool()
    got = stare_token_weights(logprobs, adv, mask, selection="phi", phi=phi, variant="C2", w=1.5, m=0.5, damp=0.8)
    for b in range(B):
        for t in range(T):
            a, f = A[b, t].item(), phi[b, t].item()
            if not valid[b, t] or a == 0:
                want = 1.0
            elif a > 0:
                want = 1.5 if f > 0 else 0.8
            else:
                want = 0.5 if f > 0 else 1.0
            assert got[b, t].item() == pytest.approx(want), (b, t)
    # O1 leaves A < 0 alone
    o1 = stare_token_weights(logprobs, adv, mask, selection="phi", phi=phi, variant="O1", w=1.5)
    assert torch.equal(o1[(A < 0) & valid], torch.ones(int(((A < 0) & valid).sum())))
    # cap: only the top 30% by Phi of the A>0, Phi>0 tokens
    capped = stare_token_weights(logprobs, adv, mask, selection="phi", phi=phi, w=1.5, phi_cap=0.3)
    cand = ((A > 0) & valid & (phi > 0))
    values = sorted(phi[cand].tolist(), reverse=True)
    k = max(1, math.ceil(Fraction("0.3") * len(values)))
    assert torch.equal(capped == 1.5, cand & (phi >= values[k - 1]))
    # direction -1 mirrors: the A>0 tokens that LOWER entropy are the boosted ones
    down = stare_token_weights(logprobs, adv, mask, selection="phi", phi=phi, w=1.5, direction=-1)
    assert torch.equal(down == 1.5, (A > 0) & valid & (phi < 0))


@pytest.mark.parametrize("phi_tol", [0.3, 1.0])
def test_phi_tol_keeps_near_zero_phi_neutral_and_ramps_by_hand(phi_tol):
    """phi_tol by hand: tau = phi_tol * mean |A Phi| over the A != 0 response tokens; a token counts as entropy-raising
    by r = clamp((|A| Phi + tau) / (2 tau), 0, 1) (1/2 at Phi = 0): weight damp + r (W - damp) for A > 0 and
    1 + r (M - 1) for A < 0."""
    g = torch.Generator().manual_seed(11)
    B, T = 8, 20
    logprobs, adv, mask = random_batch(B, T, seed=11)
    phi = torch.randn(B, T, generator=g) * torch.rand(B, T, generator=g) ** 3  # many near zero
    A = adv[:, None].expand(B, T)
    valid = mask.bool()
    cells = [(b, t) for b in range(B) for t in range(T) if valid[b, t] and A[b, t] != 0]
    tau = phi_tol * sum(abs(float(A[c]) * float(phi[c])) for c in cells) / len(cells)
    got = stare_token_weights(logprobs, adv, mask, selection="phi", phi=phi, variant="C2", w=2.0, m=0.05, damp=0.2,
                              phi_tol=phi_tol)
    ramped = near_zero = 0
    for b in range(B):
        for t in range(T):
            a, f = A[b, t].item(), phi[b, t].item()
            r = min(1.0, max(0.0, (abs(a) * f + tau) / (2 * tau)))
            if not valid[b, t] or a == 0:
                want = 1.0
            elif a > 0:
                want = 0.2 + r * (2.0 - 0.2)
            else:
                want = 1.0 + r * (0.05 - 1.0)
            ramped += 0 < r < 1
            near_zero += f < 0 < r and a > 0 and bool(valid[b, t])
            assert got[b, t].item() == pytest.approx(want, rel=1e-5, abs=1e-6), (b, t)
    assert ramped > 0 and near_zero > 0  # some tokens on the ramp, some with a small negative Phi not fully damped
    # phi_tol 0 is the plain sign rule
    plain = stare_token_weights(logprobs, adv, mask, selection="phi", phi=phi, variant="C2", w=2.0, m=0.05, damp=0.2)
    assert torch.equal(plain, stare_token_weights(logprobs, adv, mask, selection="phi", phi=phi, variant="C2", w=2.0,
                                                  m=0.05, damp=0.2, phi_tol=0.0))
    assert not torch.equal(plain, got)


def test_phi_tol_a_sign_flip_in_the_last_bits_moves_no_weight():
    """A near-zero Phi that flips sign (a last-bit difference between two machines) moves its token's weight from
    W to damp under the sign rule, and not at all with phi_tol; the weights are continuous in Phi."""
    logprobs, adv, mask = random_batch(4, 6, seed=3)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    mask = torch.ones(4, 6, dtype=torch.bool)
    phi = torch.randn(4, 6, generator=torch.Generator().manual_seed(4))
    kw = dict(selection="phi", variant="C2", w=2.0, m=0.05, damp=0.2)
    for tol in (0.0, 0.1):
        up, down = phi.clone(), phi.clone()
        up[0, 0], down[0, 0] = 3e-8, -3e-8
        wu = stare_token_weights(logprobs, adv, mask, phi=up, phi_tol=tol, **kw)
        wd = stare_token_weights(logprobs, adv, mask, phi=down, phi_tol=tol, **kw)
        if tol == 0:
            assert (wu[0, 0].item(), wd[0, 0].item()) == (2.0, pytest.approx(0.2))
        else:
            # either sign: the mean of the two weights the sign rule picks from, (W + damp) / 2
            assert wu[0, 0].item() == pytest.approx(1.1, abs=1e-6) and wd[0, 0].item() == pytest.approx(1.1, abs=1e-6)
            # a relative change of 1e-6 in every Phi moves every weight by at most 1e-6 x (W - 1) x 2 x |A Phi| / tau
            wobble = stare_token_weights(logprobs, adv, mask, phi=phi * (1 + 1e-6), phi_tol=tol, **kw)
            base = stare_token_weights(logprobs, adv, mask, phi=phi, phi_tol=tol, **kw)
            assert (wobble - base).abs().max().item() < 1e-3


def test_direction_minus_one_selects_lowest_surprisal():
    logprobs, adv, mask = random_batch(seed=8)
    down = stare_token_weights(logprobs, adv, mask, top_ratio=0.2, w=1.5, direction=-1)
    # mirroring the surprisal is the same as ranking by log-prob instead of -log-prob
    want = brute_force_paper(-logprobs, adv, mask, 0.2, 1.5, 1.0, "O1")
    assert torch.equal(down, want)


def test_twenty_million_tokens():
    # torch.quantile refuses inputs above ~16.7M elements; the selection must not
    g = torch.Generator().manual_seed(9)
    B, T = 2000, 10_000
    logprobs = -torch.rand(B, T, generator=g) * 5
    adv = torch.where(torch.arange(B) % 2 == 0, 1.0, -1.0)
    mask = torch.ones(B, T, dtype=torch.bool)
    weights = stare_token_weights(logprobs, adv, mask, variant="C2")
    pos_rows = weights[0::2]
    selected = pos_rows == 1.1
    k = top_count(0.1, pos_rows.numel())
    assert int(selected.sum()) >= k
    # every selected token is at least as surprising as every unselected one
    surprisal = -logprobs[0::2]
    assert surprisal[selected].min() >= surprisal[~selected].max()


def test_ordered_keys_and_back():
    x = torch.tensor([-float("inf"), -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, 7.25, float("inf")])
    keys = _ordered_keys(x)
    assert torch.all(keys[1:] >= keys[:-1]) and keys.min() >= 0 and keys.max() < 2 ** 32
    assert [_key_to_float(int(k)) for k in keys] == x.tolist()


def test_bad_arguments_name_themselves():
    logprobs, adv, mask = random_batch()
    for kwargs, pattern in [
        (dict(top_ratio=1.5), "top_ratio must be in \\[0, 1\\]"),
        (dict(w=0.0), "w must be in \\(0"),
        (dict(m=-1.0), "m must be in \\(0"),
        (dict(variant="C3"), "unknown variant 'C3'; valid choices: O1, C2"),
        (dict(selection="phi"), "needs the phi tensor"),
        (dict(damp=0.5), "damp != 1 needs the phi tensor"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            stare_token_weights(logprobs, adv, mask, **kwargs)
    bad = logprobs.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="logprobs holds 1 non-finite"):
        stare_token_weights(bad, adv, mask)
    with pytest.raises(ValueError, match="mask has shape"):
        stare_token_weights(logprobs, adv, mask[:, :3])


# ---- two-process gloo group: each rank holds part of the batch ------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_batch():
    """The gloo test's batch, made on CPU (the worker processes' device) whatever the test device."""
    logprobs, adv, mask = random_batch(B=14, T=33, seed=12, ties=True, device="cpu")
    phi = torch.randn(14, 33, generator=torch.Generator(device="cpu").manual_seed(13), device="cpu")
    return logprobs, adv, mask, phi


def _gloo_worker(rank, world, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        logprobs, adv, mask, phi = gloo_batch()
        rows = slice(0, 5) if rank == 0 else slice(5, 14)  # unequal shares
        results = {}
        for name, kw in {
            "paper_c2": dict(variant="C2"),
            "paper_p03": dict(variant="C2", top_ratio=0.3),
            "phi_cap": dict(selection="phi", phi=phi[rows], variant="C2", phi_cap=0.25, damp=0.7),
            "phi_tol": dict(selection="phi", phi=phi[rows], variant="C2", damp=0.7, phi_tol=0.5),
        }.items():
            results[name] = stare_token_weights(logprobs[rows], adv[rows], mask[rows], group=dist.group.WORLD, **kw)
        # kth_largest over the union, with negative values and ties; a rank may hold nothing
        vals = torch.tensor([-2.0, 3.0, 3.0, -0.5, 7.0]) if rank == 0 else torch.tensor([1.0, 3.0, -9.0])
        results["kth"] = torch.tensor([kth_largest(vals, k, dist.group.WORLD) for k in range(1, 9)])
        empty = torch.tensor([]) if rank == 0 else torch.tensor([4.0, 5.0])
        results["kth_empty"] = torch.tensor([kth_largest(empty, k, dist.group.WORLD) for k in (1, 2)])
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_gloo_group_equals_single_process(tmp_path):
    mp.spawn(_gloo_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    # the one-process reference on the test device (the GPU under --device cuda), from the workers' CPU batch
    dev = torch.empty(0).device
    logprobs, adv, mask, phi = (x.to(dev) for x in gloo_batch())
    single = {
        "paper_c2": stare_token_weights(logprobs, adv, mask, variant="C2"),
        "paper_p03": stare_token_weights(logprobs, adv, mask, variant="C2", top_ratio=0.3),
        "phi_cap": stare_token_weights(logprobs, adv, mask, selection="phi", phi=phi, variant="C2", phi_cap=0.25,
                                       damp=0.7),
        "phi_tol": stare_token_weights(logprobs, adv, mask, selection="phi", phi=phi, variant="C2", damp=0.7,
                                       phi_tol=0.5),
    }
    for name, want in single.items():
        got, want = torch.cat([r0[name], r1[name]]), want.cpu()  # the workers' results are CPU tensors
        if dev.type == "cpu":
            assert torch.equal(got, want), name
        else:  # the same selection; a weight's last bit may differ between devices (a fused multiply-add)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert not torch.equal(want, torch.ones_like(want))  # the check is not vacuous
    union = sorted([-2.0, 3.0, 3.0, -0.5, 7.0, 1.0, 3.0, -9.0], reverse=True)
    assert r0["kth"].tolist() == union == r1["kth"].tolist()
    assert r0["kth_empty"].tolist() == [5.0, 4.0] == r1["kth_empty"].tolist()
