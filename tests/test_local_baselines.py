"""The entropy baselines (clip-cov, kl-cov, 80-20, entropy-adv, entropy-adaptive) in the local engine and its CLI: the
rule or the bonus reaches the loss, Clip-Cov's generator and the bonus's coefficient make a resumed run continue
identically, `stare train` / `stare run` run them."""
from __future__ import annotations

import csv
import json

import pytest
import torch
from test_local_engine import FAST, read_metrics, stare

from stare.cli.local import trainer as local_trainer
from stare.cli.presets import resolve


# the rules only need some policy that gets some groups right (dynamic sampling); a short evaluation
QUICK = FAST + ["eval_problems=4"]


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """One warm start folder shared by this module's in-process runs (trained by the first that needs it), on one
    torch thread as the engine runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tmp_path_factory.mktemp("warm") / "warmstart"
    torch.set_num_threads(threads)


def _trainer(algo, run_dir, warm, *sets):
    run_dir.mkdir(parents=True, exist_ok=True)
    return local_trainer.LocalTrainer(resolve("tiny-cpu", algo, QUICK + list(sets)), run_dir, warmstart_dir=warm)


def _one_step(algo, run_dir, warm, monkeypatch, *sets):
    """One training step; returns (trainer, its record, the stare_step calls, the policy_loss calls)."""
    steps, losses = [], []
    real_step, real_loss = local_trainer.stare_step, local_trainer.policy_loss

    def spy_step(*a, **k):
        result = real_step(*a, **k)
        steps.append((k.get("generator"), k.get("micro_batches"), result))
        return result

    def spy_loss(lp, old, adv, mask, **k):
        loss, m = real_loss(lp, old, adv, mask, **k)
        losses.append((lp.detach(), old, adv, mask, k, loss.detach()))
        return loss, m

    monkeypatch.setattr(local_trainer, "stare_step", spy_step)
    monkeypatch.setattr(local_trainer, "policy_loss", spy_loss)
    t = _trainer(algo, run_dir, warm, *sets)
    t._build(t._initial_policy_dir())
    return t, t.train_step(), steps, losses


def test_kl_cov_loss_is_unclipped_surrogate_plus_the_penalty(tmp_path, warm, monkeypatch):
    t, rec, steps, losses = _one_step("kl-cov", tmp_path / "kl", warm, monkeypatch, "k_ratio=0.1", "kl_cov_coef=2.0")
    [(gen, micros, step)] = steps
    assert gen is None and step.weights is None and step.penalty is not None
    order = torch.cat(micros)
    assert len(losses) == len(micros)
    n_tok = step.metrics["stare/tokens"]
    assert rec["stare/penalised_share"] == pytest.approx(float((step.penalty > 0).sum()) / n_tok)
    assert rec["stare/penalised_share"] > 0
    for (lp, old, adv, mask, kw, loss), micro in zip(losses, micros):
        assert kw["clip"] is False and torch.equal(kw["penalty"], step.penalty[micro])
        # the loss written out: -A r + c |log p - log p_old| per token, token-mean over the mini-batch's tokens
        m = mask.float()
        a = adv[:, None] if adv.dim() == 1 else adv
        per_token = -a * torch.exp(lp - old) + kw["penalty"] * (lp - old).abs()
        assert float(loss) == pytest.approx(float((per_token * m).sum() / kw["num_tokens"]), rel=1e-5, abs=1e-7)
    assert sorted(order.tolist()) == list(range(step.penalty.shape[0]))


def test_clip_cov_and_80_20_weights_reach_the_loss_and_only_clip_cov_draws(tmp_path, warm, monkeypatch):
    for algo, sets in (("clip-cov", ("clip_ratio=0.1", "cov_low=0")), ("80-20", ()), ("grpo", ())):
        monkeypatch.undo()
        t, rec, steps, losses = _one_step(algo, tmp_path / algo, warm, monkeypatch, *sets)
        [(gen, micros, step)] = steps
        before = torch.Generator(t.device).manual_seed(local_trainer.clip_cov_seed(t.s["seed"]))
        if algo == "grpo":
            assert gen is None and step.weights is None and step.penalty is None
            assert torch.equal(t.clip_gen.get_state(), before.get_state())  # never touched
            assert all(kw["weights"] is None and kw["penalty"] is None and kw["clip"] for *_, kw, _ in losses)
            continue
        assert (gen is t.clip_gen) == (algo == "clip-cov")
        assert torch.equal(t.clip_gen.get_state(), before.get_state()) == (algo != "clip-cov")
        mask = step.weights.new_zeros(step.weights.shape, dtype=torch.bool)
        for (_, _, _, m, kw, _), micro in zip(losses, micros):
            assert kw["clip"] is True and kw["penalty"] is None and torch.equal(kw["weights"], step.weights[micro])
            mask[micro] = m.bool()
        dropped = (step.weights == 0) & mask
        assert rec["stare/masked_share"] == pytest.approx(float(dropped.sum()) / float(mask.sum()))
        assert dropped.any()


def test_clip_cov_resumed_run_continues_identically(tmp_path, warm):
    sets = ("steps=4", "save_every=2", "clip_ratio=0.1", "cov_low=0")
    straight = _trainer("clip-cov", tmp_path / "straight", warm, *sets).run()

    class Killed(Exception):
        pass

    def kill(step, steps, rec):
        if step == 3:  # after step 3's metrics, before its checkpoint (there is one at step 2)
            raise Killed

    with pytest.raises(Killed):
        _trainer("clip-cov", tmp_path / "killed", warm, *sets).run(on_step=kill)
    resumed = _trainer("clip-cov", tmp_path / "killed", warm, *sets).run(resume=True)

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "time_s"} for r in rows]

    a, b = strip(read_metrics(tmp_path / "straight")), strip(read_metrics(tmp_path / "killed"))
    assert [r["step"] for r in b] == [1, 2, 3, 4] and a == b
    assert all(r["stare/masked_share"] > 0 for r in a if not r.get("skipped"))
    assert straight == resumed


def test_stare_run_trains_the_baselines_named_with_set_algos(tmp_path):
    out = tmp_path / "run"
    sets = sum((["--set", s] for s in QUICK + ["steps=2", "algos=kl-cov,80-20"]), [])
    res = stare("run", "--preset", "tiny-cpu", "--out", str(out), *sets)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = list(csv.DictReader((out / "comparison.csv").open()))
    assert [r["arm"] for r in rows if r["arm"] != "warmstart"] == ["kl-cov", "80-20"]
    metrics = {arm: [r for r in read_metrics(out / arm) if not r.get("skipped")] for arm in ("kl-cov", "80-20")}
    assert all(metrics.values())
    # 80-20: the gradient flows through the top 20% by entropy (ties at the threshold all kept)
    # (the share is a float32: exactly 0.8 when ceil(0.2 N) tokens are kept reads 0.80000001)
    assert all(0.7 < r["stare/masked_share"] <= 0.8 + 1e-6 and r["stare/entropy"] > 0 for r in metrics["80-20"])
    # the kept tokens carry N / S, so the token-mean loss is the mean over the selected ones: mean weight 1
    assert all(r["stare/mean_weight"] == pytest.approx(1.0, abs=1e-6) for r in metrics["80-20"])
    assert all(r["stare/penalised_share"] > 0 and r["stare/masked_share"] == 0 for r in metrics["kl-cov"])
    assert json.loads((out / "kl-cov" / "eval.json").read_text())["algo"] == "kl-cov"


def test_the_adaptive_entropy_bonus_reaches_the_loss_and_a_resumed_run_continues_identically(tmp_path, warm,
                                                                                             monkeypatch):
    """entropy-adaptive in the local engine: the step's coefficient (target above the entropy: delta at step 1) goes
    to entropy_bonus_loss with the current policy's entropy (with its gradient) and the policy loss's counts; a run
    killed after step 3 and resumed from step 2's checkpoint logs what the straight run logs (the coefficient's
    state is in the checkpoint: without it step 3 would apply 0.1, not 0.3)."""
    bonus_calls = []
    real_bonus = local_trainer.entropy_bonus_loss

    def spy_bonus(entropy, mask, coef, **k):
        bonus_calls.append((entropy, coef, k))
        return real_bonus(entropy, mask, coef, **k)

    monkeypatch.setattr(local_trainer, "entropy_bonus_loss", spy_bonus)
    t, rec, steps, losses = _one_step("entropy-adaptive", tmp_path / "one", warm, monkeypatch,
                                      "entropy_target=5", "entropy_coef_delta=0.1")
    [(_, micros, step)] = steps
    assert step.entropy_coef == pytest.approx(0.1) and rec["stare/entropy_coef"] == pytest.approx(0.1)
    assert len(bonus_calls) == len(losses) == len(micros)
    for (entropy, coef, k), (*_, kw, _) in zip(bonus_calls, losses):
        assert coef == step.entropy_coef and entropy.requires_grad
        assert (k["agg"], k["num_tokens"], k["num_seqs"]) == (kw["agg"], kw["num_tokens"], kw["num_seqs"])
    assert rec["stare/entropy_bonus"] > 0 and 0 < rec["stare/entropy_bonus_share"] < 1
    monkeypatch.undo()

    sets = ("steps=4", "save_every=2", "entropy_target=5", "entropy_coef_delta=0.1")
    straight = _trainer("entropy-adaptive", tmp_path / "straight", warm, *sets).run()

    class Killed(Exception):
        pass

    def kill(step, steps, rec):
        if step == 3:
            raise Killed

    with pytest.raises(Killed):
        _trainer("entropy-adaptive", tmp_path / "killed", warm, *sets).run(on_step=kill)
    resumed = _trainer("entropy-adaptive", tmp_path / "killed", warm, *sets).run(resume=True)
    a = [{k: v for k, v in r.items() if k != "time_s"} for r in read_metrics(tmp_path / "straight")]
    b = [{k: v for k, v in r.items() if k != "time_s"} for r in read_metrics(tmp_path / "killed")]
    assert a == b and [r["step"] for r in b] == [1, 2, 3, 4]
    trained = [r["stare/entropy_coef"] for r in a if not r.get("skipped")]
    assert trained == pytest.approx([0.1 * (i + 1) for i in range(len(trained))])
    assert straight == resumed


def test_entropy_adv_weights_reach_the_loss(tmp_path, warm, monkeypatch):
    from stare.algorithms import entropy_advantage_weights

    t, rec, steps, losses = _one_step("entropy-adv", tmp_path / "adv", warm, monkeypatch)
    [(_, micros, step)] = steps
    assert step.weights is not None and step.penalty is None
    for (_, _, adv, mask, kw, _), micro in zip(losses, micros):
        assert kw["clip"] is True and torch.equal(kw["weights"], step.weights[micro])
    assert rec["stare/shaped_share"] > 0 and rec["stare/positive_reweight_ratio"] > 0
    assert not torch.equal(step.weights, torch.ones_like(step.weights))
    # the weights are the shaping of the step's advantages by the old policy's entropy
    seen = {}
    real = local_trainer.stare_step

    def keep(*a, **k):
        seen["args"] = a
        return real(*a, **k)

    monkeypatch.setattr(local_trainer, "stare_step", keep)
    t2 = _trainer("entropy-adv", tmp_path / "adv2", warm)
    t2._build(t2._initial_policy_dir())
    t2.train_step()
    _, cfg, logp, adv, mask, stats = seen["args"]
    assert torch.equal(real(None, cfg, logp, adv, mask, stats).weights,
                       entropy_advantage_weights(adv, stats.entropy, mask, alpha=0.4, kappa=2.0))


@pytest.mark.parametrize("algo,metric", [("dg", "stare/gate_mean"), ("steer", "stare/steer_floor_share")])
def test_dg_and_steer_weights_reach_the_loss(tmp_path, warm, monkeypatch, algo, metric):
    """The local engine's step: the rule's weights (computed here from the step's own inputs by the pure function,
    and checked against those inputs' definition in tests/test_delight_gate.py and tests/test_steer.py) go into
    every micro-batch's policy_loss, with the rule's clip; its telemetry is in the step's record."""
    from stare.algorithms.baselines import delight_gate_weights, steer_weights

    t, rec, steps, losses = _one_step(algo, tmp_path / algo, warm, monkeypatch)
    [(_, micros, step)] = steps
    assert step.weights is not None and step.penalty is None
    for (_, old, adv, mask, kw, _), micro in zip(losses, micros):
        assert kw["clip"] is True and torch.equal(kw["weights"], step.weights[micro])
        assert (kw["clip_low"], kw["clip_high"]) == ((0.2, 0.2) if algo == "dg" else (0.2, 0.28))
    assert 0 < rec[metric] < 1
    old = torch.cat([o for (_, o, *_rest) in losses])
    rows = torch.cat([torch.as_tensor(m) for m in micros])
    adv = torch.cat([a for (_, _, a, *_rest) in losses])
    mask = torch.cat([m for (_, _, _, m, *_rest) in losses])
    weights = step.weights[rows]
    if algo == "dg":
        want = delight_gate_weights(old, adv, mask)
        assert torch.equal(weights, want)
    else:
        assert float(weights[mask.bool()].min()) == pytest.approx(0.8) and float(weights.max()) <= 1.0
        assert not torch.equal(weights, torch.ones_like(weights))
