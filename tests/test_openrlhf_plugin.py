"""The STARE plugin inside the pinned OpenRLHF's real ActorPPOTrainer, on the CPU with a tiny random Llama.

OpenRLHF is installed without flash-attn and vLLM; stand-ins for those two modules exist in this test process
only. DeepSpeed's engine is replaced by a small strategy object that does what DeepSpeed does to the loss
(divide by the accumulation steps) and never steps the optimizer, so the gradients accumulated over a whole
RL step can be compared with references computed independently.
"""
from __future__ import annotations

import copy
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("openrlhf")
pytest.importorskip("deepspeed")
import openrlhf_standins  # noqa: E402

openrlhf_standins.install()
from openrlhf.models import Actor  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ray import ppo_actor  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from stare.algorithms import get_algorithm  # noqa: E402
from stare.cli.openrlhf_backend import compat, plugin  # noqa: E402
from stare.cli.openrlhf_backend.argv import SETTINGS_ENV  # noqa: E402

V, PROMPT, RESP, B = 48, 4, 7, 8  # vocabulary, prompt length, longest response, sequences


def _args(agg="token-mean", clip=(0.2, 0.28), dual_clip=10.0):
    return openrlhf_standins.openrlhf_args(agg, clip, dual_clip)


class _Strategy:
    """What ActorPPOTrainer needs of DeepSpeedStrategy: backward divides by the accumulation steps."""

    ring_attn_group = None

    def __init__(self, args, gas=1):
        self.args, self.accumulated_gradient = args, gas

    def backward(self, loss, model, optimizer):
        (loss / self.accumulated_gradient).backward()

    def optimizer_step(self, *a, **k):
        pass  # gradients accumulate over the whole step; the tests compare them

    def get_grad_norm(self, model):
        return 0.0

    def all_reduce(self, data, op="mean"):
        return data

    def is_rank_0(self):
        return True

    def print(self, *a):
        pass


class _Sched:
    def get_last_lr(self):
        return [0.0]


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float()


def _trainer(monkeypatch, model, args, gas=1):
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    actor = Actor(model)
    actor.packing_samples = False
    optim = torch.optim.SGD(actor.parameters(), lr=0.0)
    trainer = ppo_actor.ActorPPOTrainer(_Strategy(args, gas), actor, None, optim, _Sched(),
                                        micro_train_batch_size=2, buffer_cpu_offload=False,
                                        dataloader_pin_memory=False)
    return trainer


def _experience(model, seed=1):
    """B sequences (2 prompts x 4 samples), right-padded responses, old log-probs off-policy by noise."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 5, 6, 3, 7, 4, 7, 6])
    seq = torch.randint(1, V, (B, PROMPT + RESP), generator=g)
    attn = torch.ones(B, PROMPT + RESP, dtype=torch.long)
    for i, n in enumerate(lengths):
        attn[i, PROMPT + n:] = 0
        seq[i, PROMPT + n:] = 0
    action_mask = attn[:, 1:][:, -RESP:].bool()
    with torch.no_grad():
        logits = model(seq, attention_mask=attn).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, seq[:, 1:, None]).squeeze(-1)[:, -RESP:]
    old = (logp + 0.1 * torch.randn(logp.shape, generator=g)) * action_mask
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    r = rewards.view(2, 4)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    advantages = adv[:, None].expand(B, RESP) * action_mask
    return Experience(sequences=seq, attention_mask=attn, action_mask=action_mask, action_log_probs=old,
                      advantages=advantages.float().contiguous(), response_length=lengths.float(),
                      total_length=(lengths + PROMPT).float(), info={"reward": rewards.clone()})


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _settings_env(monkeypatch, algo, **overrides):
    cfg = get_algorithm(algo, **overrides)
    monkeypatch.setenv(SETTINGS_ENV, json.dumps({"algo": cfg.to_dict(), "run": "test"}))
    return cfg


def _install(trainer):
    host = SimpleNamespace(trainer=trainer)
    return plugin.install(host)


def test_plugin_refuses_other_openrlhf_versions():
    with pytest.raises(plugin.OpenRLHFVersionError, match=re.escape(plugin.OPENRLHF_VERSION) + ".*found 0\\.0\\.1"):
        plugin.check_openrlhf_version("0.0.1")
    assert plugin.check_openrlhf_version() == plugin.OPENRLHF_VERSION


def test_loss_arity_is_the_pinned_versions():
    loss = plugin.StarePolicyLoss.from_parsed(compat.PolicyLoss())
    x = torch.zeros(2, 3)
    out = loss(x, x, torch.ones(2, 3), action_mask=torch.ones(2, 3))
    assert len(out) == 5  # the pinned release returns (loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)


def test_gate_off_equals_openrlhfs_own_loss_bit_for_bit(monkeypatch):
    args = _args()
    exp = _experience(_model())
    # OpenRLHF's own trainer
    m_ref = _model()
    ref = _trainer(monkeypatch, m_ref, args)
    status_ref = ref.training_step(copy.deepcopy(exp), 0.0, 0)
    # ours, with the gate off (entropy far above a tiny target)
    _settings_env(monkeypatch, "stare", target_entropy=1e-6)
    m_ours = _model()
    ours = _install(_trainer(monkeypatch, m_ours, args))
    assert type(ours.actor_loss_fn) is plugin.StarePolicyLoss
    for key in ("clip_eps_low", "clip_eps_high", "dual_clip", "token_level_loss", "policy_loss_type"):
        assert getattr(ours.actor_loss_fn, key) == getattr(ref.actor_loss_fn, key)
    ours.replay_buffer.append(copy.deepcopy(exp))
    metrics = ours.stare.prepare_step()
    assert metrics["stare/gate_on"] == 0.0
    status = ours.training_step(copy.deepcopy(exp), 0.0, 0)
    assert torch.equal(status["metrics"]["policy_loss"], status_ref["metrics"]["policy_loss"])
    assert torch.equal(_grads(m_ours), _grads(m_ref))


def _brute_force_weights(exp, ratio=0.1, w=1.1):
    """The paper's O1 rule by sorting: top ceil(ratio * n) surprisal among A > 0 tokens of the whole batch."""
    mask = exp.action_mask
    pos = mask & (exp.advantages > 0)
    s = -exp.action_log_probs[pos]
    k = math.ceil(round(ratio * s.numel(), 9))
    threshold = torch.sort(s, descending=True).values[k - 1]
    weights = torch.ones_like(exp.advantages)
    weights[pos & (-exp.action_log_probs >= threshold)] = w
    return weights, int((pos & (-exp.action_log_probs >= threshold)).sum())


def _hand_loss(model, exp, weights, clip=(0.2, 0.28), dual_clip=10.0):
    """PPO's clipped loss with dual clip, per token, times the weight, token-mean over the batch (by hand)."""
    logits = model(exp.sequences, attention_mask=exp.attention_mask,
                   position_ids=(exp.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, exp.sequences[:, 1:, None]).squeeze(-1)[:, -RESP:]
    ratio = torch.exp(logp - exp.action_log_probs)
    a = exp.advantages
    per_token = -torch.minimum(ratio * a, ratio.clamp(1 - clip[0], 1 + clip[1]) * a)
    per_token = torch.where(a < 0, torch.minimum(per_token, -dual_clip * a), per_token)
    m = exp.action_mask.float()
    return (per_token * weights * m).sum() / m.sum()


def test_weights_apply_exactly_on_the_selected_tokens_over_the_whole_step(monkeypatch):
    args = _args()
    exp = _experience(_model())
    weights, n_selected = _brute_force_weights(exp, w=2.0)
    assert 0 < n_selected < int((exp.action_mask & (exp.advantages > 0)).sum())
    # ours: the step goes through OpenRLHF's ppo_train -> shuffled micro-batches of 2 -> training_step
    _settings_env(monkeypatch, "stare", target_entropy=100.0, w=2.0)  # gate on
    m_ours = _model()
    ours = _install(_trainer(monkeypatch, m_ours, args, gas=B // 2))
    ours.replay_buffer.append(copy.deepcopy(exp))
    seen = []
    real_forward = plugin.StarePolicyLoss.forward

    def spy(self, *a, **k):
        seen.append(None if self.token_weights is None else self.token_weights.clone())
        return real_forward(self, *a, **k)

    monkeypatch.setattr(plugin.StarePolicyLoss, "forward", spy)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    status = ours.ppo_train(0.0)
    assert len(seen) == B // 2 and all(w is not None for w in seen)
    g_ours = _grads(m_ours)

    # reference 1: OpenRLHF's own loss over the whole batch, the weights folded into the advantages
    m_ref = _model()
    ref = _trainer(monkeypatch, m_ref, args)
    folded = copy.deepcopy(exp)
    folded.advantages = exp.advantages * weights
    n_tok = exp.action_mask.sum().float()
    ref.training_step(folded, 0.0, 0, {"dp_size": 1, "batch_num_tokens": n_tok, "global_batch_size": float(B)})
    assert torch.allclose(g_ours, _grads(m_ref), rtol=1e-5, atol=1e-7)

    # reference 2: the weighted clipped loss written out by hand
    m_hand = _model()
    _hand_loss(m_hand, exp, weights).backward()
    assert torch.allclose(g_ours, _grads(m_hand), rtol=1e-4, atol=1e-6)

    # and the weights are not a no-op: without them the gradient differs well beyond rounding
    m_plain = _model()
    _hand_loss(m_plain, exp, torch.ones_like(weights)).backward()
    assert (g_ours - _grads(m_plain)).abs().max() > 1e-3 * g_ours.abs().max()

    # telemetry, in the step's status (OpenRLHF logs it as train/<key>)
    for key in ("stare/entropy", "stare/gate_on", "stare/w", "stare/m", "stare/target", "stare/strength",
                "stare/positive_reweight_ratio", "stare/negative_reweight_ratio", "stare/mean_weight",
                "stare/pos_low_share", "stare/pos_high_share", "stare/neg_low_share", "stare/neg_high_share",
                "stare/entropy_forecast", "stare/entropy_forecast_base", "policy_loss"):
        assert key in status, key
    assert status["stare/gate_on"] == 1.0 and status["stare/w"] == pytest.approx(2.0)
    n_pos = int((exp.action_mask & (exp.advantages > 0)).sum())
    assert status["stare/positive_reweight_ratio"] == pytest.approx(n_selected / n_pos)
    assert status["stare/negative_reweight_ratio"] == 0.0
    quad = sum(status[f"stare/{q}_share"] for q in ("pos_low", "pos_high", "neg_low", "neg_high"))
    assert quad == pytest.approx(1.0)
    # the batch entropy: full softmax of the model's logits at the response positions, computed here
    with torch.no_grad():
        logits = _model()(exp.sequences, attention_mask=exp.attention_mask,
                          position_ids=(exp.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits.float()
    p = torch.softmax(logits[:, :-1][:, -RESP:], -1)
    h = -(p * p.clamp_min(1e-30).log()).sum(-1)
    m = exp.action_mask.float()
    assert status["stare/entropy"] == pytest.approx(float((h * m).sum() / m.sum()), rel=1e-5)


def test_micro_batch_scope_selects_inside_each_micro_batch(monkeypatch):
    args = _args()
    exp = _experience(_model())
    _settings_env(monkeypatch, "stare", target_entropy=100.0, scope="micro_batch")
    ours = _install(_trainer(monkeypatch, _model(), args, gas=B // 2))
    ours.replay_buffer.append(copy.deepcopy(exp))
    seen = []
    real_forward = plugin.StarePolicyLoss.forward

    def spy(self, log_probs, old_log_probs, advantages, action_mask=None, *a, **k):
        seen.append((self.token_weights.clone(), old_log_probs.clone(), advantages.clone(), action_mask.clone()))
        return real_forward(self, log_probs, old_log_probs, advantages, action_mask, *a, **k)

    monkeypatch.setattr(plugin.StarePolicyLoss, "forward", spy)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    ours.ppo_train(0.0)
    assert len(seen) == B // 2
    for w, old, adv, mask in seen:  # each micro-batch: exactly its own top ceil(10%) surprisal A>0 tokens
        pos = mask.bool() & (adv > 0)
        if not pos.any():
            assert torch.all(w[mask.bool()] == 1.0)
            continue
        s = -old[pos]
        k = math.ceil(round(0.1 * s.numel(), 9))
        thr = torch.sort(s, descending=True).values[k - 1]
        expected = pos & (-old >= thr)
        assert torch.equal(w[mask.bool()] != 1.0, expected[mask.bool()])


def test_controller_state_is_saved_with_the_checkpoint_and_restored(monkeypatch, tmp_path):
    args = _args()
    _settings_env(monkeypatch, "stare", target_entropy=100.0, adaptive=True, alpha=0.05)
    exp = _experience(_model())
    a = _install(_trainer(monkeypatch, _model(), args))
    for _ in range(3):
        a.replay_buffer.items.clear()
        a.replay_buffer.append(copy.deepcopy(exp))
        a.stare.prepare_step()
    assert a.stare.controller.w == pytest.approx(1.1 + 3 * 0.05)
    (tmp_path / "_actor" / "global_step3").mkdir(parents=True)  # what DeepSpeed saved just before
    (tmp_path / "_actor" / "latest").write_text("global_step3")
    plugin.save_stare_state(a, str(tmp_path), "global_step3", keep=2)
    b = _install(_trainer(monkeypatch, _model(), args))
    assert b.stare.controller.w == pytest.approx(1.1)
    assert plugin.load_stare_state(b, str(tmp_path)) == "global_step3"
    assert b.stare.controller.w == pytest.approx(a.stare.controller.w)
    assert b.stare.prev == a.stare.prev
    # the next step's measured entropy change is against the restored previous entropy
    b.replay_buffer.append(copy.deepcopy(exp))
    metrics = b.stare.prepare_step()
    assert metrics["stare/entropy_change"] == pytest.approx(0.0, abs=1e-6)


def test_baselines_get_telemetry_and_openrlhfs_loss(monkeypatch):
    args = _args(agg="seq-mean-token-mean", clip=(0.2, 0.2), dual_clip=None)
    _settings_env(monkeypatch, "grpo")
    exp = _experience(_model())
    ours = _install(_trainer(monkeypatch, _model(), args))
    ours.replay_buffer.append(copy.deepcopy(exp))
    metrics = ours.stare.prepare_step()
    assert "stare/gate_on" not in metrics and metrics["stare/mean_weight"] == 1.0
    assert metrics["stare/entropy"] > 0
    assert ours.stare.batch_weights(exp, torch.arange(B)) is None


def test_token_budget_groups_give_the_same_entropy_within_half_the_budget(monkeypatch):
    exp = _experience(_model())
    _settings_env(monkeypatch, "stare", target_entropy=100.0)
    plain = _install(_trainer(monkeypatch, _model(), _args()))
    plain.replay_buffer.append(copy.deepcopy(exp))
    expected = plain.stare.prepare_step()
    args = _args()
    args.train.dynamic_batch_enable, args.train.max_tokens_per_gpu = True, 40
    packed = _install(_trainer(monkeypatch, _model(), args))
    packed.replay_buffer.append(copy.deepcopy(exp))
    shapes = []
    real = type(packed.actor).forward

    def spy(self, sequences, *a, **k):
        shapes.append(tuple(sequences.shape))
        return real(self, sequences, *a, **k)

    monkeypatch.setattr(type(packed.actor), "forward", spy)
    got = packed.stare.prepare_step()
    assert sum(b for b, _ in shapes) == B and len(shapes) > 1
    assert all(b * t <= 20 or b == 1 for b, t in shapes)
    for key in ("stare/entropy", "stare/entropy_forecast", "stare/positive_reweight_ratio", "stare/pos_low_share"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key


def _response_entropy(model, exp):
    """The policy's entropy at each response position [B, RESP] (with its gradient), by its definition."""
    logits = model(exp.sequences, attention_mask=exp.attention_mask,
                   position_ids=(exp.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits.float()
    logp = torch.log_softmax(logits[:, :-1][:, -RESP:], -1)
    return -(logp.exp() * logp).sum(-1)


def _hand_entropy(model, exp):
    """The current policy's token entropy at the response positions, token-mean over the batch (with its gradient)."""
    m = exp.action_mask.float()
    return (_response_entropy(model, exp) * m).sum() / m.sum()


def _through_ppo_train(monkeypatch, args, algo, **overrides):
    """One step of ``algo`` through OpenRLHF's ppo_train (micro-batches of 2) on a fresh model: (trainer, model,
    experience, status)."""
    _settings_env(monkeypatch, algo, **overrides)
    exp = _experience(_model())
    model = _model()
    trainer = _install(_trainer(monkeypatch, model, args, gas=B // 2))
    trainer.replay_buffer.append(copy.deepcopy(exp))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    return trainer, model, exp, trainer.ppo_train(0.0)


def test_the_adaptive_entropy_bonus_is_openrlhfs_entropy_term_with_the_controllers_coefficient(monkeypatch, tmp_path):
    """entropy-adaptive through OpenRLHF's ppo_train: each step's coefficient (target above the entropy: up by delta
    each step) reaches OpenRLHF's own --actor.entropy_coef term, so the step's gradient is the clipped loss minus
    coef x the current policy's token-mean entropy, written out by hand; the coefficient's state is saved with the
    checkpoint and restored."""
    args = _args(clip=(0.2, 0.2), dual_clip=None)
    args.actor.entropy_coef = 0.0  # what the launch passes (argv.py): OpenRLHF computes the entropy term
    ours, m_ours, exp, status = _through_ppo_train(monkeypatch, args, "entropy-adaptive", entropy_target=100.0,
                                                   entropy_coef_delta=0.3)
    assert args.actor.entropy_coef == pytest.approx(0.3) and status["stare/entropy_coef"] == pytest.approx(0.3)
    assert status["stare/entropy_bonus"] == pytest.approx(0.3 * status["entropy_loss"])
    assert 0 < status["stare/entropy_bonus_share"] < 1
    no_dual = 1e9  # no dual clip: a cap that never binds
    m_hand = _model()
    (_hand_loss(m_hand, exp, torch.ones_like(exp.advantages), clip=(0.2, 0.2), dual_clip=no_dual)
     - 0.3 * _hand_entropy(m_hand, exp)).backward()
    g_ours = _grads(m_ours)
    assert torch.allclose(g_ours, _grads(m_hand), rtol=1e-4, atol=1e-6)
    m_plain = _model()  # and the bonus is not a no-op
    _hand_loss(m_plain, exp, torch.ones_like(exp.advantages), clip=(0.2, 0.2), dual_clip=no_dual).backward()
    assert (g_ours - _grads(m_plain)).abs().max() > 1e-3 * g_ours.abs().max()
    # the coefficient's state travels with the checkpoint: the resumed run's next step applies 0.6
    (tmp_path / "_actor" / "global_step1").mkdir(parents=True)
    (tmp_path / "_actor" / "latest").write_text("global_step1")
    plugin.save_stare_state(ours, str(tmp_path), "global_step1", keep=2)
    args_b = _args(clip=(0.2, 0.2), dual_clip=None)
    args_b.actor.entropy_coef = 0.0
    b = _install(_trainer(monkeypatch, _model(), args_b))
    assert plugin.load_stare_state(b, str(tmp_path)) == "global_step1"
    b.replay_buffer.append(copy.deepcopy(exp))
    assert b.stare.prepare_step()["stare/entropy_coef"] == pytest.approx(0.6)
    assert args_b.actor.entropy_coef == pytest.approx(0.6)


def _assert_weighted_grads(m_ours, exp, weights, *, clip, dual_clip):
    """The trained model's gradient equals that of the clipped loss with ``weights`` written out by hand
    (``_hand_loss`` on a fresh model), and differs from the unweighted loss's (the weights matter here)."""
    m_hand = _model()
    _hand_loss(m_hand, exp, weights, clip=clip, dual_clip=dual_clip).backward()
    g_ours = _grads(m_ours)
    assert torch.allclose(g_ours, _grads(m_hand), rtol=1e-4, atol=1e-6)
    m_plain = _model()
    _hand_loss(m_plain, exp, torch.ones_like(weights), clip=clip, dual_clip=dual_clip).backward()
    assert (g_ours - _grads(m_plain)).abs().max() > 1e-3 * g_ours.abs().max()


def test_entropy_adv_shapes_the_advantages_inside_openrlhfs_loss(monkeypatch):
    """entropy-adv through OpenRLHF's ppo_train: the gradient of OpenRLHF's loss equals the clipped loss with
    A + min(0.4 H, |A| / 2) written out by hand, H the old policy's entropy computed here."""
    args = _args(clip=(0.2, 0.2), dual_clip=None)
    ours, m_ours, exp, status = _through_ppo_train(monkeypatch, args, "entropy-adv")
    with torch.no_grad():
        h = _response_entropy(_model(), exp)  # the old policy's: the same weights as the trained model's start
    a = exp.advantages
    shaped = torch.where(a == 0, 0.0, a + torch.minimum(0.4 * h, a.abs() / 2.0))
    weights = torch.where(a == 0, 1.0, shaped / torch.where(a == 0, 1.0, a))
    _assert_weighted_grads(m_ours, exp, weights, clip=(0.2, 0.2), dual_clip=1e9)
    nonzero = exp.action_mask & (a != 0)
    clipped = nonzero & (0.4 * h >= a.abs() / 2)
    assert status["stare/shaped_share"] == pytest.approx(1.0)
    assert status["stare/shaping_clipped_share"] == pytest.approx(float(clipped.sum() / nonzero.sum()), abs=1e-6)


def test_dg_gates_the_loss_inside_openrlhfs_loss(monkeypatch):
    """dg through OpenRLHF's ppo_train: the gradient of OpenRLHF's loss equals GRPO's clipped loss times
    sigmoid(A (-log p_old)) written out by hand, log p_old the experience's action log-probs."""
    args = _args(clip=(0.2, 0.2), dual_clip=None)
    ours, m_ours, exp, status = _through_ppo_train(monkeypatch, args, "dg")
    a, old = exp.advantages, exp.action_log_probs
    gate = torch.where(exp.action_mask, 1.0 / (1.0 + torch.exp(a * old)), 1.0)  # sigmoid(-A log p) by its definition
    _assert_weighted_grads(m_ours, exp, gate, clip=(0.2, 0.2), dual_clip=1e9)
    acted = exp.action_mask & (a != 0)
    assert status["stare/gate_mean"] == pytest.approx(float(gate[acted].mean()), rel=1e-5)


def test_steer_weighs_the_loss_inside_openrlhfs_loss(monkeypatch):
    """steer through OpenRLHF's ppo_train: the gradient equals DAPO's clipped loss (0.2/0.28, dual clip 10) times
    clamp(exp(-k |A (1 - p) (log p + H)|), 0.8, 1), k = -ln 0.8 / max|.|, written out by hand from the experience's
    log-probs and the old policy's entropy computed here."""
    args = _args(clip=(0.2, 0.28), dual_clip=10.0)
    ours, m_ours, exp, status = _through_ppo_train(monkeypatch, args, "steer")
    with torch.no_grad():
        h = _response_entropy(_model(), exp)
    a, logp, mask = exp.advantages, exp.action_log_probs, exp.action_mask
    p = logp.exp()
    size = torch.where(mask, (a * (1 - p) * (logp + h)).abs(), 0.0)
    k = -math.log(0.8) / max(float(size.max()), 0.02)
    weights = torch.where(mask, torch.exp(-k * size).clamp(0.8, 1.0), 1.0)
    _assert_weighted_grads(m_ours, exp, weights, clip=(0.2, 0.28), dual_clip=10.0)
    assert status["stare/steer_floor_share"] == pytest.approx(1 / float(mask.sum()), rel=1e-5)
