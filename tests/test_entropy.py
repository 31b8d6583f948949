"""entropy_sensitivity against finite differences and a float64 naive formula; forecast vs a real step."""
import pytest
import torch

from stare.algorithms import entropy_sensitivity, predicted_entropy_change, quadrant_stats


def exact_entropy(z: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(z.double(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def naive_stats(logits: torch.Tensor, actions: torch.Tensor):
    """float64, unchunked, written from the definition Phi = p_a (s_a - H) - sum_j p_j^2 (s_j - H)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    p = logp.exp()
    s = -logp
    h = (p * s).sum(-1)
    s_a = s.gather(-1, actions[..., None]).squeeze(-1)
    p_a = p.gather(-1, actions[..., None]).squeeze(-1)
    phi = p_a * (s_a - h) - (p * p * (s - h[..., None])).sum(-1)
    return h, s_a, phi


def test_phi_matches_finite_differences_of_exact_entropy():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        V = int(torch.randint(2, 60, (1,), generator=g))
        z = torch.randn(V, generator=g, dtype=torch.float64) * float(torch.rand(1, generator=g) * 6)
        a = int(torch.randint(0, V, (1,), generator=g))
        p = torch.softmax(z, -1)
        direction = -p
        direction[a] += 1.0  # a policy-gradient step on token a moves logits along e_a - p
        eps = 1e-5
        fd = (exact_entropy(z + eps * direction) - exact_entropy(z - eps * direction)) / (2 * eps)
        stats = entropy_sensitivity(z[None].float(), torch.tensor([a]))
        assert stats.phi.item() == pytest.approx(fd.item(), abs=2e-6, rel=2e-4), (trial, V)


def test_phi_sign_table():
    # High-surprisal tokens (s_a > H) always raise entropy under a positive advantage: Phi > 0 exactly.
    # Low-surprisal tokens lower it "mostly"; the exact threshold is p_a (s_a - H) > sum_j p_j^2 (s_j - H).
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(1)
    N, V = 20000, 12
    logits = torch.randn(N, V, generator=g) * (torch.rand(N, 1, generator=g) * 5)
    actions = torch.distributions.Categorical(logits=logits).sample()
    stats = entropy_sensitivity(logits, actions)
    h, s_a, phi = naive_stats(logits, actions)
    high = s_a > h
    assert (stats.phi[high] > 0).all()
    assert (stats.phi[~high] < 0).float().mean() > 0.8  # "mostly": 88% of low-surprisal cases here
    decided = phi.abs() > 1e-6  # away from float32 rounding at the threshold
    assert torch.equal(torch.sign(stats.phi[decided]).double(), torch.sign(phi[decided]))
    # and the mean of Phi under a ~ p is zero: no drift from a token-independent advantage
    z = torch.randn(5, 30, generator=g)
    p = torch.softmax(z.double(), -1)
    all_actions = torch.arange(30).expand(5, 30)
    phis = torch.stack([entropy_sensitivity(z, all_actions[:, j]).phi.double() for j in range(30)], -1)
    assert (p * phis).sum(-1).abs().max() < 1e-6


def test_chunked_equals_naive_at_qwen_vocabulary():
    g = torch.Generator().manual_seed(2)
    V = 151_936
    logits = torch.randn(3, 11, V, generator=g) * 3
    logits[0, 0] *= 10  # a very peaked row
    actions = torch.randint(0, V, (3, 11), generator=g)
    h, s_a, phi = naive_stats(logits, actions)
    # float32 sums over V terms: rounding grows like eps * sqrt(V) relative (4.6e-5 here). Measured: below 1e-5 on
    # AVX-512 machines, 1.3e-5 on an AVX2 one (entropy, same inputs); a wrong term or chunk is off by far more
    tol = torch.finfo(torch.float32).eps * V ** 0.5
    for chunk in (None, 1, 7, 1000):
        stats = entropy_sensitivity(logits, actions, chunk_size=chunk)
        assert stats.entropy.shape == (3, 11) and stats.entropy.dtype == torch.float32
        torch.testing.assert_close(stats.entropy.double(), h, atol=tol, rtol=tol)
        torch.testing.assert_close(stats.surprisal.double(), s_a, atol=tol, rtol=tol)
        torch.testing.assert_close(stats.phi.double(), phi, atol=tol, rtol=tol)


def test_bf16_logits_accumulate_in_float32_and_temperature():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(16, 5000, generator=g) * 4).to(torch.bfloat16)
    actions = torch.randint(0, 5000, (16,), generator=g)
    stats = entropy_sensitivity(logits, actions, chunk_size=5)
    h, s_a, phi = naive_stats(logits.float(), actions)
    torch.testing.assert_close(stats.entropy.double(), h, atol=1e-5, rtol=1e-5)
    hot = entropy_sensitivity(logits, actions, temperature=0.7)
    h7, _, phi7 = naive_stats(logits.float() / 0.7, actions)
    torch.testing.assert_close(hot.entropy.double(), h7, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hot.phi.double(), phi7, atol=1e-5, rtol=1e-5)


def test_no_gradient_and_bad_inputs():
    logits = torch.randn(4, 10, requires_grad=True)
    stats = entropy_sensitivity(logits, torch.zeros(4, dtype=torch.long))
    assert not stats.phi.requires_grad
    with pytest.raises(ValueError, match="actions must have the logits' shape"):
        entropy_sensitivity(logits, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="integer token ids"):
        entropy_sensitivity(logits, torch.zeros(4))


def test_forecast_predicts_a_real_gradient_step():
    # Tabular policy: each position owns its logits. A step on loss -sum_t A_t log p(a_t) moves position t's
    # logits by eta A_t (e_a - p), so the mean entropy change is eta * mean(A Phi) to first order.
    torch.manual_seed(4)
    g = torch.Generator().manual_seed(4)
    N, V = 64, 9
    z = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    actions = torch.distributions.Categorical(logits=z).sample()
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    mask = torch.ones(N, dtype=torch.float64)
    mask[-5:] = 0
    stats = entropy_sensitivity(z, actions)
    forecast = predicted_entropy_change(stats.phi[None], adv[None], mask[None])
    eta = 1e-4
    zz = z.clone().requires_grad_(True)
    logp = torch.log_softmax(zz, -1).gather(-1, actions[:, None]).squeeze(-1)
    (-(adv * logp * mask).sum()).backward()
    # central difference along the gradient step: second-order terms cancel
    measured = ((exact_entropy(z - eta * zz.grad) - exact_entropy(z + eta * zz.grad)) * mask).sum() / mask.sum() / (2 * eta)
    assert forecast.item() == pytest.approx(measured.item(), rel=1e-4)
    # with weights, each token's step is scaled by its weight
    w = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    zz.grad = None
    logp = torch.log_softmax(zz, -1).gather(-1, actions[:, None]).squeeze(-1)
    (-(w * adv * logp * mask).sum()).backward()
    measured_w = ((exact_entropy(z - eta * zz.grad) - exact_entropy(z + eta * zz.grad)) * mask).sum() / mask.sum() / (2 * eta)
    forecast_w = predicted_entropy_change(stats.phi[None], adv[None], mask[None], weights=w[None])
    assert forecast_w.item() == pytest.approx(measured_w.item(), rel=1e-4)


def test_quadrant_stats_against_counting():
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(5)
    B, T, V = 6, 15, 8
    logits = torch.randn(B, T, V, generator=g) * 2
    actions = torch.distributions.Categorical(logits=logits).sample()
    adv = torch.randn(B, generator=g)
    adv[0] = 0
    mask = (torch.rand(B, T, generator=g) < 0.8).float()
    st = entropy_sensitivity(logits, actions)
    q = quadrant_stats(st.surprisal, st.entropy, adv, mask, phi=st.phi)
    counts = {"pos_low": 0, "pos_high": 0, "neg_low": 0, "neg_high": 0}
    contrib = dict.fromkeys(counts, 0.0)
    for b in range(B):
        for t in range(T):
            A = adv[b].item()
            if not mask[b, t] or A == 0:
                continue
            key = ("pos" if A > 0 else "neg") + ("_high" if st.surprisal[b, t] > st.entropy[b, t] else "_low")
            counts[key] += 1
            contrib[key] += A * st.phi[b, t].item()
    active = sum(counts.values())
    for k in counts:
        assert q[f"{k}_share"].item() == pytest.approx(counts[k] / active)
        assert q[f"{k}_contrib"].item() == pytest.approx(contrib[k] / mask.sum().item(), abs=1e-7)
    total = sum(q[f"{k}_contrib"] for k in counts)
    assert total.item() == pytest.approx(predicted_entropy_change(st.phi, adv, mask).item(), abs=1e-7)


def test_without_phi_the_entropy_and_surprisal_are_the_same_numbers():
    """with_phi=False (the gate's entropy only) skips Phi and leaves H and s bit for bit as with Phi."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 7, 300, generator=g) * 3
    actions = torch.randint(0, 300, (5, 7), generator=g)
    full = entropy_sensitivity(logits, actions, chunk_size=4, kernel="torch")
    lean = entropy_sensitivity(logits, actions, chunk_size=4, kernel="torch", with_phi=False)
    assert lean.phi is None and full.phi is not None
    assert torch.equal(lean.entropy, full.entropy) and torch.equal(lean.surprisal, full.surprisal)
    # and H is the float64 full-softmax entropy
    p = torch.softmax(logits.double(), -1)
    assert torch.allclose(lean.entropy.double(), -(p * p.log()).sum(-1), atol=1e-5)


def _large_buffers(fn, rows: int, vocab: int) -> int:
    """How many fresh tensors of at least rows x vocab elements the aten ops run by ``fn`` allocate."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.numel() >= rows * vocab \
                        and t.untyped_storage().data_ptr() not in inputs:
                    Count.n += 1
            return out

    with Count():
        fn()
    return Count.n


def test_torch_path_allocates_few_chunk_buffers():
    """The torch path holds p and log p (which becomes p log p, then p^2 log p, in place), with or without Phi,
    instead of a fresh [rows, V] tensor per product (an older path allocated 5 with Phi, 3 without), and the two
    buffers serve every chunk of the call (fresh ones per chunk page-fault in again when the allocator has handed
    them back); bf16 logits and a temperature are converted into the log p buffer, not a third one. The numbers
    are the float64 formula's."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 500, generator=g) * 4
    actions = torch.randint(0, 500, (6,), generator=g)
    for with_phi in (True, False):
        assert _large_buffers(lambda: entropy_sensitivity(logits, actions, kernel="torch", with_phi=with_phi),
                              6, 500) == 2
        for x, temperature in ((logits, 1.0), (logits, 0.7), (logits.to(torch.bfloat16), 1.0), (logits[:, ::2], 1.3)):
            # three chunks of two rows: still two [2, V] buffers in all
            a = actions % x.shape[-1]
            assert _large_buffers(lambda: entropy_sensitivity(x, a, kernel="torch", with_phi=with_phi, chunk_size=2,
                                                              temperature=temperature),
                                  2, x.shape[-1]) == 2, (x.dtype, temperature)
    h, s_a, phi = naive_stats(logits, actions)
    st = entropy_sensitivity(logits, actions, kernel="torch")
    torch.testing.assert_close(st.entropy.double(), h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st.surprisal.double(), s_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st.phi.double(), phi, atol=1e-5, rtol=1e-5)


def test_torch_path_takes_one_exponential_per_logit():
    """The exponential is the costly part on CPU: one softmax over each chunk, and no other op that exponentiates or
    takes logs over [rows, V] (log_softmax followed by exp did it twice). Counted, not timed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    transcendental = ("softmax", "log_softmax", "exp", "log", "logsumexp", "xlogy", "special_entr")
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            big = any(isinstance(t, torch.Tensor) and t.numel() >= 3 * 700
                      for t in torch.utils._pytree.tree_leaves((args, kwargs)))
            name = func.overloadpacket.__name__.lstrip("_").rstrip("_")
            if big and name in transcendental:
                seen.append(name)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 3, 700, generator=g) * 3
    actions = torch.randint(0, 700, (4, 3), generator=g)
    for with_phi in (True, False):
        seen.clear()
        with Ops():
            st = entropy_sensitivity(logits, actions, chunk_size=3, kernel="torch", with_phi=with_phi)
        assert seen == ["softmax"] * 4, (with_phi, seen)  # 12 rows in chunks of 3
        h, s_a, phi = naive_stats(logits.view(12, 700), actions.view(12))
        torch.testing.assert_close(st.entropy.view(12).double(), h, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(st.surprisal.view(12).double(), s_a, atol=1e-5, rtol=1e-5)
