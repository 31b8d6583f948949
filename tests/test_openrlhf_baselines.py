"""The entropy baselines (Clip-Cov, KL-Cov, 80/20) inside the pinned OpenRLHF's real ``ppo_train``, on the CPU.

The same set-up as test_openrlhf_plugin.py (tiny random Llama, OpenRLHF's own ``ActorPPOTrainer``, a strategy
that accumulates the whole step's gradient). Each baseline's gradient is compared with a loss written out here
from the same tensors over the whole batch: the token rule by brute force (sorting, the covariance from its
definition, the entropy from a full softmax), PPO's per-token loss by hand, and both of OpenRLHF's aggregations
(token-level and sequence-level) by hand.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("openrlhf")
pytest.importorskip("deepspeed")
import test_openrlhf_plugin as base  # noqa: E402  (installs the flash-attn / vLLM stand-ins)
import test_openrlhf_stash as stash_tests  # noqa: E402

from stare.algorithms import clip_cov_seed  # noqa: E402
from stare.cli.openrlhf_backend import plugin  # noqa: E402

B, RESP = base.B, base.RESP
CLIP, DUAL = (0.2, 0.28), 10.0  # what OpenRLHF parsed (the DAPO-style flags): KL-Cov must switch both off
AGGS = ("token-mean", "seq-mean-token-mean")


def _off_policy(exp, scale=0.4):
    """The experience with old log-probs further from the current policy, so PPO's clip acts on many tokens."""
    g = torch.Generator().manual_seed(5)
    exp.action_log_probs = (exp.action_log_probs + scale * torch.randn(exp.action_log_probs.shape, generator=g)) \
        * exp.action_mask
    return exp


# ---- the references, written out ------------------------------------------------------------------------------


def _covariance(exp):
    """(A - mean A) (log p_old - mean log p_old), both means over the response tokens of the whole batch."""
    m = exp.action_mask.bool()
    a, lp = exp.advantages.double(), exp.action_log_probs.double()
    return torch.where(m, (a - a[m].mean()) * (lp - lp[m].mean()), torch.zeros_like(a))


def _kl_cov_coefs(exp, k_ratio, kl_coef):
    m = exp.action_mask.bool()
    cov = _covariance(exp)
    k = max(1, math.floor(k_ratio * int(m.sum())))
    thr = torch.sort(cov[m], descending=True).values[k - 1]
    return torch.where(m & (cov >= thr), kl_coef, 0.0).double(), k


def _clip_cov_candidates(exp, cov_low, cov_high):
    cov = _covariance(exp)
    return exp.action_mask.bool() & (cov > cov_low) & (cov < cov_high)


def _top_entropy_mask(model, exp, ratio):
    """1 on the top ceil(ratio * N) response tokens by the old policy's entropy (full softmax), 0 on the others."""
    h, _, _ = stash_tests._brute(model, exp)
    m = exp.action_mask.bool()
    k = math.ceil(round(ratio * int(m.sum()), 9))
    thr = torch.sort(h[m], descending=True).values[k - 1]
    return torch.where(m & (h < thr), 0.0, 1.0).double(), k


def _logp(model, exp):
    logits = model(exp.sequences, attention_mask=exp.attention_mask,
                   position_ids=(exp.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, exp.sequences[:, 1:, None]).squeeze(-1)[:, -RESP:]


def _aggregate(per_token, mask, agg):
    m = mask.to(per_token.dtype)
    if agg == "token-mean":
        return (per_token * m).sum() / m.sum()
    return ((per_token * m).sum(-1) / m.sum(-1)).mean()  # every sample has response tokens here


def _hand_loss(model, exp, agg, *, weights=None, coefs=None, clipped=True):
    """PPO's per-token loss (clip 0.2/0.28 and dual clip 10, or -A r unclipped), times the weight, plus
    c |log p - log p_old|, aggregated over the whole batch by OpenRLHF's rule for ``agg``."""
    logp = _logp(model, exp)
    ratio = torch.exp(logp - exp.action_log_probs)
    a = exp.advantages
    if clipped:
        per_token = -torch.minimum(ratio * a, ratio.clamp(1 - CLIP[0], 1 + CLIP[1]) * a)
        per_token = torch.where(a < 0, torch.minimum(per_token, -DUAL * a), per_token)
    else:
        per_token = -ratio * a
    if weights is not None:
        per_token = per_token * weights.to(per_token.dtype)
    if coefs is not None:
        per_token = per_token + coefs.to(per_token.dtype) * (logp - exp.action_log_probs).abs()
    return _aggregate(per_token, exp.action_mask, agg)


# ---- driving OpenRLHF's ppo_train ---------------------------------------------------------------------------


def _run_step(monkeypatch, algo, agg, exp, *, stash=False, seed=7, steps_before=0, **overrides):
    """One RL step through OpenRLHF's ppo_train (shuffled micro-batches of 2, one optimizer-step window) with the
    plugin installed; returns (model, trainer, status, {uid: weights row}, {uid: coefficient row})."""
    base._settings_env(monkeypatch, algo, **overrides)
    args = base._args(agg=agg, clip=CLIP, dual_clip=DUAL)
    args.train.seed = seed
    model = base._model()
    trainer = base._install(base._trainer(monkeypatch, model, args, gas=B // 2))
    trainer.stare.steps = steps_before
    if stash:  # the old log-probs from the plugin's forward, which stashes each sample's entropy
        exp = stash_tests._old_experience(trainer, exp)
    trainer.replay_buffer.append(copy.deepcopy(exp))
    rows, coefs = {}, {}
    real = trainer.stare.prepare_step

    def spy():
        metrics = real()
        rows.update({u: None if w is None else w.clone() for u, (w, _) in trainer.stare.rows.items()})
        coefs.update({u: c.clone() for u, c in trainer.stare.penalty_rows.items()})
        return metrics

    trainer.stare.prepare_step = spy
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    status = trainer.ppo_train(0.0)
    return model, trainer, status, rows, coefs


def _full(rows, fill):
    """The per-uid rows (uid = sample index: the buffer keeps the order) as [B, RESP], right-padded."""
    out = torch.full((B, RESP), fill, dtype=torch.float64)
    for u, r in rows.items():
        out[u, : r.shape[0]] = r.double()
    return out


def _hand_grads(exp, agg, **kw):
    """The gradient of ``_hand_loss`` for a fresh copy of the test model."""
    model = base._model()
    _hand_loss(model, exp, agg, **kw).backward()
    return base._grads(model)


def _differs(g, other):
    return bool((g - other).abs().max() > 1e-3 * g.abs().max())


# ---- the tests -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", AGGS)
def test_kl_cov_is_openrlhfs_unclipped_loss_plus_the_penalty_aggregated_like_it(monkeypatch, agg):
    exp = _off_policy(base._experience(base._model()))
    expected, k = _kl_cov_coefs(exp, 0.1, 2.0)
    assert k >= 4
    model, trainer, status, rows, coefs = _run_step(monkeypatch, "kl-cov", agg, exp, telemetry="off",
                                                   k_ratio=0.1, kl_cov_coef=2.0)
    # the loss OpenRLHF runs: its own, every clip branch off
    loss_fn = trainer.actor_loss_fn
    assert (loss_fn.clip_eps_low, loss_fn.clip_eps_high, loss_fn.dual_clip) == (math.inf, math.inf, None)
    assert loss_fn.token_level_loss == (agg == "token-mean")
    # the coefficients: kl_cov_coef on the top k tokens by covariance (brute force), 0 elsewhere; no weights
    assert torch.equal(_full(coefs, 0.0), expected)
    assert all(w is None for w in rows.values())
    g = base._grads(model)
    assert torch.allclose(g, _hand_grads(exp, agg, coefs=expected, clipped=False), rtol=1e-4, atol=1e-6)
    # the penalty and the unclipping are both there, and the aggregation is the one OpenRLHF's settings say
    assert _differs(g, _hand_grads(exp, agg, coefs=None, clipped=False))
    assert _differs(g, _hand_grads(exp, agg, coefs=expected, clipped=True))
    assert _differs(g, _hand_grads(exp, AGGS[1 - AGGS.index(agg)], coefs=expected, clipped=False))
    assert status["ppo_clip_ratio"] == 0.0  # OpenRLHF's own clip statistic: nothing clipped


@pytest.mark.parametrize("agg", AGGS)
def test_clip_cov_drops_candidates_through_the_weights_and_keeps_openrlhfs_denominators(monkeypatch, agg):
    exp = base._experience(base._model())
    cand = _clip_cov_candidates(exp, 0.0, 5.0)
    n_tok = int(exp.action_mask.sum())
    count = min(max(1, math.floor(0.2 * n_tok)), int(cand.sum()))
    assert count >= 4 and int(cand.sum()) > count  # a random choice among more candidates than it takes
    model, trainer, status, rows, coefs = _run_step(monkeypatch, "clip-cov", agg, exp, telemetry="off",
                                                   clip_ratio=0.2, cov_low=0.0, cov_high=5.0)
    assert not coefs and trainer.actor_loss_fn.clip_eps_high == CLIP[1] and trainer.actor_loss_fn.dual_clip == DUAL
    w = _full(rows, 1.0)
    dropped = w == 0
    assert set(w.unique().tolist()) <= {0.0, 1.0}
    assert int(dropped.sum()) == count and bool((dropped <= cand).all())  # only candidates, exactly `count`
    g = base._grads(model)
    assert torch.allclose(g, _hand_grads(exp, agg, weights=w), rtol=1e-4, atol=1e-6)
    # the dropped tokens stay in the denominators: dividing by the kept tokens only is another gradient
    kept = copy.deepcopy(exp)
    kept.action_mask = exp.action_mask & ~dropped
    assert _differs(g, _hand_grads(kept, agg))
    assert _differs(g, _hand_grads(exp, agg))  # and the mask is not a no-op


def test_clip_cov_reproduces_per_seed_rank_and_step(monkeypatch):
    exp = base._experience(base._model())
    kw = dict(telemetry="off", clip_ratio=0.2, cov_low=0.0, cov_high=5.0)

    def mask(**run):
        _, _, _, rows, _ = _run_step(monkeypatch, "clip-cov", "token-mean", exp, **run, **kw)
        return _full(rows, 1.0)

    first = mask(seed=7)
    assert torch.equal(first, mask(seed=7))  # the same run again: the same tokens
    assert not torch.equal(first, mask(seed=8))  # another seed
    assert not torch.equal(first, mask(seed=7, steps_before=1))  # the next step draws afresh
    assert clip_cov_seed(7, 0, 0) != clip_cov_seed(7, 1, 0)  # ranks draw their own keys


def test_clip_cov_step_count_is_saved_with_the_checkpoint(monkeypatch, tmp_path):
    exp = base._experience(base._model())
    _, a, _, _, _ = _run_step(monkeypatch, "clip-cov", "token-mean", exp, telemetry="off")
    assert a.stare.steps == 1
    (tmp_path / "_actor" / "global_step1").mkdir(parents=True)  # what DeepSpeed saved just before
    (tmp_path / "_actor" / "latest").write_text("global_step1")
    plugin.save_stare_state(a, str(tmp_path), "global_step1", keep=2)
    b = base._install(base._trainer(monkeypatch, base._model(), base._args()))
    assert b.stare.steps == 0
    plugin.load_stare_state(b, str(tmp_path))
    assert b.stare.steps == 1


@pytest.mark.parametrize("agg", AGGS)
def test_80_20_trains_on_the_top_entropy_tokens_from_the_stashed_forward(monkeypatch, agg):
    model0 = base._model()
    exp = base._experience(model0)
    calls = stash_tests._fail_extra_pass(monkeypatch)
    model, trainer, status, rows, coefs = _run_step(monkeypatch, "80-20", agg, exp, stash=True, telemetry="off")
    assert calls == [] and status["stare/stash_recomputed"] == 0.0  # the entropy came from the stash
    # the old log-probs the buffer holds are the plugin's forward's: the references use the same
    e = stash_tests._old_experience(base._install(base._trainer(monkeypatch, base._model(), base._args())), exp)
    expected, k = _top_entropy_mask(model0, e, 0.2)
    valid = e.action_mask.bool()
    n = int(valid.sum())
    w = _full(rows, 1.0)
    # the registry's 80-20 divides by the selected tokens: the k kept ones carry N / k, so OpenRLHF's
    # token-mean over N tokens is the mean over the k (the 80/20 paper's code)
    assert int((w[valid] != 0).sum()) == k and torch.equal(w == 0, expected == 0)
    assert torch.allclose(w[valid & (w != 0)], torch.tensor(n / k, dtype=w.dtype))
    g = base._grads(model)
    # the loss is linear in the weights: N / k times the gradient through the 0/1 mask
    assert torch.allclose(g, _hand_grads(e, agg, weights=expected) * (n / k), rtol=1e-4, atol=1e-6)
    assert _differs(g, _hand_grads(e, agg))  # the mask is not a no-op
    # mask_denominator all (TRL's choice, this project's before): the plain 0/1 mask, divided by all N tokens
    model, _, _, rows, _ = _run_step(monkeypatch, "80-20", agg, exp, stash=True, telemetry="off",
                                     mask_denominator="all")
    assert torch.equal(_full(rows, 1.0), expected)
    assert torch.allclose(base._grads(model), _hand_grads(e, agg, weights=expected), rtol=1e-4, atol=1e-6)


def test_baselines_log_their_shares_with_full_telemetry(monkeypatch):
    exp = base._experience(base._model())
    n_tok = int(exp.action_mask.sum())
    _, _, status, rows, _ = _run_step(monkeypatch, "clip-cov", "token-mean", exp, clip_ratio=0.2, cov_low=0.0)
    assert status["stare/masked_share"] == pytest.approx(int((_full(rows, 1.0) == 0).sum()) / n_tok)
    _, k = _kl_cov_coefs(exp, 0.1, 1.0)
    _, _, status, _, _ = _run_step(monkeypatch, "kl-cov", "token-mean", exp, k_ratio=0.1)
    assert status["stare/penalised_share"] == pytest.approx(k / n_tok)
    assert status["stare/masked_share"] == 0.0 and status["stare/entropy"] > 0
