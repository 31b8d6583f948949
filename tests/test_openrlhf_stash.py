"""Entropy and Phi from OpenRLHF's own old-log-prob forward, stashed per sample and used by ``ppo_train``.

The pinned OpenRLHF's real ``Actor`` and ``ActorPPOTrainer`` on the CPU with a tiny random Llama (see
test_openrlhf_plugin.py). The references are computed here by brute force from the model's logits.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("openrlhf")
pytest.importorskip("deepspeed")
import test_openrlhf_plugin as base  # noqa: E402  (installs the flash-attn / vLLM stand-ins)
from openrlhf.models import ring_attn_utils  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402

from stare.cli.openrlhf_backend import actor as seam_actor  # noqa: E402
from stare.cli.openrlhf_backend import plugin, stats, step  # noqa: E402

B, PROMPT, RESP = base.B, base.PROMPT, base.RESP


def _brute(model, exp):
    """Entropy, log p(action) and Phi [B, A] at the response positions, by full softmax (float64)."""
    with torch.no_grad():
        logits = model(exp.sequences, attention_mask=exp.attention_mask,
                       position_ids=(exp.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits.double()
    return _stats_from_rows(logits[:, :-1][:, -RESP:], exp.sequences[:, 1:][:, -RESP:])


def _stats_from_rows(z, actions):
    logp = torch.log_softmax(z.double(), -1)
    p = logp.exp()
    h = -(p * logp).sum(-1)
    la = logp.gather(-1, actions[..., None]).squeeze(-1)
    # Phi = p_a (s_a - H) - sum_j p_j^2 (s_j - H), written out from the definition
    phi = la.exp() * (-la - h) - (p * p * (-logp - h[..., None])).sum(-1)
    return h, la, phi


def _old_experience(trainer, exp):
    """The experience as the driver builds it: old log-probs from the plugin's forward (which stashes)."""
    e = copy.deepcopy(exp)
    lp = trainer.stare.stash.old_log_probs(e.sequences, e.action_mask, e.attention_mask)
    e.action_log_probs = lp.detach() * e.action_mask
    return e


def _fail_extra_pass(monkeypatch):
    calls = []
    real = stats.Stash.recompute

    def spy(self, items, spare=None):
        calls.append(len(items))
        return real(self, items, spare)

    monkeypatch.setattr(stats.Stash, "recompute", spy)
    return calls


def test_the_old_log_prob_forward_is_openrlhfs_and_its_stash_serves_the_step(monkeypatch):
    model = base._model()
    exp = base._experience(model)
    base._settings_env(monkeypatch, "stare", target_entropy=100.0)
    trainer = base._install(base._trainer(monkeypatch, base._model(), base._args()))
    # the log-probs returned are exactly what OpenRLHF's actor forward returns
    with torch.no_grad():
        own = trainer.actor(exp.sequences, exp.action_mask, exp.attention_mask)
    e = _old_experience(trainer, exp)
    assert torch.equal(trainer.stare.stash.old_log_probs(exp.sequences, exp.action_mask, exp.attention_mask), own)
    assert len(trainer.stare.stash.rows) == B
    # the buffer splits the batch and strips the right padding; the stash still finds every sample
    trainer.replay_buffer.append(e)
    calls = _fail_extra_pass(monkeypatch)
    found = trainer.stare.stash.step_stats(trainer.replay_buffer.items)
    assert calls == [] and trainer.stare.stash.report["recomputed"] == 0
    h, _, phi = _brute(model, exp)
    for b, (ent_b, phi_b) in enumerate(found):
        n = int(exp.attention_mask[b].sum()) - PROMPT  # the response length without right padding
        assert ent_b.shape == (n,) and phi_b.shape == (n,)
        assert torch.allclose(ent_b.double(), h[b, :n], atol=2e-5), b
        assert torch.allclose(phi_b.double(), phi[b, :n], atol=2e-5), b
    # and the step's metrics equal the extra pass's (the old code path) on a trainer without a stash
    got = trainer.stare.prepare_step()
    other = base._install(base._trainer(monkeypatch, base._model(), base._args()))
    other.replay_buffer.append(copy.deepcopy(e))
    expected = other.stare.prepare_step()
    assert calls == [B]  # only the trainer without a stash ran the extra pass
    assert other.stare.stash.report["recomputed"] == B
    for key in ("stare/entropy", "stare/entropy_forecast", "stare/pos_low_contrib", "stare/positive_reweight_ratio"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    assert got["stare/entropy"] == pytest.approx(float((h * exp.action_mask).sum() / exp.action_mask.sum()), rel=1e-5)


def test_the_stash_never_serves_a_row_from_before_an_update(monkeypatch):
    model = base._model()
    exp = base._experience(model)
    base._settings_env(monkeypatch, "grpo")  # telemetry only: the entropy is reported every step
    m = base._model()
    trainer = base._install(base._trainer(monkeypatch, m, base._args(agg="seq-mean-token-mean")))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    e = _old_experience(trainer, exp)
    trainer.replay_buffer.append(copy.deepcopy(e))
    status1 = trainer.ppo_train(0.0)
    assert status1["stare/stash_recomputed"] == 0.0 and trainer.stare.stash.rows == {}
    h1, _, _ = _brute(model, exp)
    mask = exp.action_mask.double()
    assert status1["stare/entropy"] == pytest.approx(float((h1 * mask).sum() / mask.sum()), rel=1e-5)
    # the weights change (an update); the same samples come back without passing the forward again
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.5)
    h2, _, _ = _brute(m, exp)
    expected2 = float((h2 * mask).sum() / mask.sum())
    assert abs(expected2 - status1["stare/entropy"]) > 1e-2  # the change is visible in the entropy
    trainer.replay_buffer.items.clear()
    trainer.replay_buffer.append(copy.deepcopy(e))
    status2 = trainer.ppo_train(0.0)
    assert status2["stare/stash_recomputed"] == float(B)
    assert status2["stare/entropy"] == pytest.approx(expected2, rel=1e-5)
    # a row stashed and then invalidated by an update is not used even if it is still in the dict
    trainer.replay_buffer.items.clear()
    e3 = _old_experience(trainer, exp)
    stale = dict(trainer.stare.stash.rows)
    trainer.stare.stash.clear()
    trainer.stare.stash.rows.update(stale)  # older version
    trainer.replay_buffer.append(e3)
    trainer.stare.prepare_step()
    assert trainer.stare.stash.report["recomputed"] == B


@pytest.mark.parametrize("kernel", ["torch", "compiled", "cpp"])
def test_statistics_come_from_the_models_own_logits_at_the_rollout_temperature(monkeypatch, kernel):
    """The statistics are taken by a hook on the model, before ``Actor.forward`` divides the logits by the
    temperature in place: they must still be those of the temperature-scaled policy, OpenRLHF's log-probs must be
    unchanged bit for bit, and the hook must be gone afterwards."""
    model = base._model()
    exp = base._experience(model)
    base._settings_env(monkeypatch, "stare-phi", stats_kernel=kernel)
    trainer = base._install(base._trainer(monkeypatch, base._model(), base._args()))
    trainer.actor.temperature = 0.7
    with torch.no_grad():
        own = trainer.actor(exp.sequences, exp.action_mask, exp.attention_mask)
    hooks_before = dict(trainer.actor.model._forward_hooks)
    log_probs, ent, phi = trainer.stare.stash.forward_stats(exp.sequences, exp.action_mask, exp.attention_mask)
    assert torch.equal(log_probs, own)
    assert dict(trainer.actor.model._forward_hooks) == hooks_before
    with torch.no_grad():
        logits = model(exp.sequences, attention_mask=exp.attention_mask,
                       position_ids=(exp.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits.double() / 0.7
    h, la, want_phi = _stats_from_rows(logits[:, :-1][:, -RESP:], exp.sequences[:, 1:][:, -RESP:])
    mask = exp.action_mask.bool()
    assert torch.allclose(la[mask], own.double()[mask], atol=1e-5)  # the brute force is at the same temperature
    assert torch.allclose(ent.double()[mask], h[mask], atol=2e-5)
    assert torch.allclose(phi.double()[mask], want_phi[mask], atol=2e-5)
    assert (ent[~mask] == 0).all() and (phi[~mask] == 0).all()
    # and the temperature is visible at that tolerance: the statistics at temperature 1 are far from these
    h_at_1 = _stats_from_rows(logits[:, :-1][:, -RESP:] * 0.7, exp.sequences[:, 1:][:, -RESP:])[0]
    assert (ent.double()[mask] - h_at_1[mask]).abs().min() > 100 * 2e-5


@pytest.mark.parametrize("algo", ["grpo", "stare", "stare-phi"])
def test_telemetry_setting_limits_what_is_computed(monkeypatch, algo):
    model = base._model()
    exp = base._experience(model)
    over = {} if algo == "grpo" else {"target_entropy": 100.0} if algo == "stare" else {"band_low": 99.0,
                                                                                         "band_high": 100.0}
    results = {}
    real = stats.entropy_sensitivity
    for mode in ("full", "entropy", "off"):
        base._settings_env(monkeypatch, algo, telemetry=mode, **over)
        trainer = base._install(base._trainer(monkeypatch, base._model(), base._args()))
        calls = []
        monkeypatch.setattr(stats, "entropy_sensitivity", lambda *a, **k: calls.append(1) or real(*a, **k))
        e = _old_experience(trainer, exp)
        trainer.replay_buffer.append(e)
        metrics = trainer.stare.prepare_step()
        stash_phi = {v[2] is None for v in trainer.stare.stash.rows.values()}
        weights = [trainer.stare.rows[u][0] for u in sorted(trainer.stare.rows)]
        results[mode] = (metrics, calls, stash_phi, weights)
    full, ent, off = results["full"], results["entropy"], results["off"]
    assert "stare/entropy_forecast" in full[0] and "stare/pos_low_share" in full[0]
    assert full[2] == {False}
    for mode in (ent, off):
        assert not any(k.endswith(("_forecast", "_contrib", "_share", "reweight_ratio")) for k in mode[0])
    if algo == "grpo":
        assert ent[0]["stare/entropy"] == pytest.approx(full[0]["stare/entropy"])
        assert ent[2] == {True}  # no Phi kept
        assert off[0] == {} and off[1] == [] and off[2] == set()  # nothing computed at all
    else:
        # the gate needs the entropy whatever the telemetry; stare-phi needs Phi regardless
        for mode in (ent, off):
            assert mode[0]["stare/entropy"] == pytest.approx(full[0]["stare/entropy"])
            assert mode[0]["stare/gate_on"] == 1.0
            assert mode[2] == ({False} if algo == "stare-phi" else {True})
            assert all(torch.equal(a, b) for a, b in zip(mode[3], full[3]))


# ---- packing: statistics on the packed rows, unpacked as OpenRLHF unpacks its log-probs -------------------


def _unpad_input(hidden_states, attention_mask, unused_mask=None):
    """flash_attn.bert_padding.unpad_input (pure torch there too): keep the attended positions, flattened."""
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu, int(seqlens.max()), seqlens


def _pad_input(hidden_states, indices, batch, seqlen):
    out = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype,
                      device=hidden_states.device)
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def _packing(monkeypatch):
    import einops

    monkeypatch.setattr(ring_attn_utils, "unpad_input", _unpad_input)
    monkeypatch.setattr(ring_attn_utils, "pad_input", _pad_input)
    monkeypatch.setattr(ring_attn_utils, "index_first_axis", lambda x, idx: x[idx])
    monkeypatch.setattr(ring_attn_utils, "rearrange", einops.rearrange)


def _left_padded(exp):
    """Some prompts shorter (left padding), as OpenRLHF's rollout batches have them."""
    e = copy.deepcopy(exp)
    for b, pad in ((1, 2), (4, 1), (6, 3)):
        e.sequences[b, :pad] = 0
        e.attention_mask[b, :pad] = 0
    return e


def test_packed_forward_stashes_the_statistics_of_the_packed_rows(monkeypatch):
    _packing(monkeypatch)
    model = base._model()
    exp = _left_padded(base._experience(model))
    base._settings_env(monkeypatch, "stare", target_entropy=100.0)
    args = base._args()
    args.ds.packing_samples = True
    trainer = base._install(base._trainer(monkeypatch, base._model(), args))
    trainer.actor.packing_samples = True
    lp = trainer.stare.stash.old_log_probs(exp.sequences, exp.action_mask, exp.attention_mask)
    # the reference: the same packed forward done here, row by row, mapped back by hand
    attn = exp.attention_mask
    idx = attn.flatten().nonzero().flatten()
    with torch.no_grad():
        packed = model(exp.sequences.flatten()[idx][None], attention_mask=None,
                       position_ids=((attn.cumsum(-1) - 1).clamp(min=0)).flatten()[idx][None]).logits[0].double()
    rows_h, rows_la, rows_phi = _stats_from_rows(packed[:-1], exp.sequences.flatten()[idx][1:])
    T = exp.sequences.shape[1]
    offsets = torch.cumsum(attn.sum(-1), 0) - attn.sum(-1)
    found = 0
    for b in range(B):
        left = int((attn[b] == 0).long().cumprod(0).sum())
        n_resp = int(exp.action_mask[b].sum())
        key, _ = stats.sample_key(exp.sequences[b], attn[b])
        _, ent, phi = trainer.stare.stash.rows[key]
        assert ent.shape[0] == n_resp
        for j in range(n_resp):
            t = T - 1 - RESP + j  # the logits row of action j in the padded grid
            r = int(offsets[b]) + t - left
            assert ent[j].item() == pytest.approx(rows_h[r].item(), abs=2e-5)
            assert phi[j].item() == pytest.approx(rows_phi[r].item(), abs=2e-5)
            assert lp[b, j].item() == pytest.approx(rows_la[r].item(), abs=2e-5)  # OpenRLHF's own unpacking
            found += 1
    assert found == int(exp.action_mask.sum())
    # the replay buffer finds them all (packed: the same keys)
    e = copy.deepcopy(exp)
    e.action_log_probs = lp * exp.action_mask
    trainer.replay_buffer.append(e)
    calls = _fail_extra_pass(monkeypatch)
    trainer.stare.prepare_step()
    assert calls == [] and trainer.stare.stash.report["recomputed"] == 0


def test_sample_key_matches_what_the_replay_buffer_keeps():
    from openrlhf.trainer.ppo_utils.experience import remove_padding_in_sequences, split_experience_batch

    exp = _left_padded(base._experience(base._model()))
    items = remove_padding_in_sequences(split_experience_batch(copy.deepcopy(exp)))
    keys = set()
    for b, item in enumerate(items):
        key, right = stats.sample_key(exp.sequences[b], exp.attention_mask[b])
        assert stats.sample_key(item.sequences, item.attention_mask) == (key, 0)
        assert item.action_mask.shape[0] == RESP - right
        keys.add(key)
    assert len(keys) == B
    assert isinstance(items[0], Experience)


def test_the_policy_actors_forward_returns_openrlhfs_and_stashes(monkeypatch):
    """``StarePolicyModelActor.forward`` (what the driver's experience maker calls through Ray) against the
    class it overrides, on the same inputs."""
    exp = base._experience(base._model())
    base._settings_env(monkeypatch, "stare", target_entropy=100.0)
    trainer = base._install(base._trainer(monkeypatch, base._model(), base._args()))
    host = object.__new__(plugin.StarePolicyModelActor)  # no Ray: the plain class behind the remote one
    host.actor, host.trainer, host.strategy = trainer.actor, trainer, trainer.strategy
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    ours = host.forward(exp.sequences, exp.action_mask, exp.attention_mask)
    assert host.actor.training  # reset to training mode, as OpenRLHF's forward does
    own = seam_actor._BasePolicyActor.forward(host, exp.sequences, exp.action_mask, exp.attention_mask)
    assert torch.equal(ours, own) and ours.device.type == "cpu"
    assert len(trainer.stare.stash.rows) == B
    # a trainer that is not STARE's: OpenRLHF's forward unchanged
    plain = object.__new__(plugin.StarePolicyModelActor)
    plain.actor, plain.trainer, plain.strategy = trainer.actor, SimpleNamespace(), trainer.strategy
    assert torch.equal(plain.forward(exp.sequences, exp.action_mask, exp.attention_mask), own)


def test_micro_batch_scope_without_phi_selects_the_same_tokens(monkeypatch):
    """scope micro_batch with telemetry that keeps no Phi (O1 needs none): the same weights as with full."""
    exp = base._experience(base._model())
    seen = {}
    real_forward = plugin.StarePolicyLoss.forward
    for mode in ("full", "entropy"):
        base._settings_env(monkeypatch, "stare", target_entropy=100.0, scope="micro_batch", telemetry=mode)
        trainer = base._install(base._trainer(monkeypatch, base._model(), base._args(), gas=B // 2))
        e = _old_experience(trainer, exp)
        trainer.replay_buffer.append(e)
        got = seen.setdefault(mode, [])

        def spy(self, log_probs, old_log_probs, advantages, action_mask=None, *a, _got=got, **k):
            _got.append((old_log_probs.sum().item(), self.token_weights.clone()))
            return real_forward(self, log_probs, old_log_probs, advantages, action_mask, *a, **k)

        monkeypatch.setattr(plugin.StarePolicyLoss, "forward", spy)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
        torch.manual_seed(0)  # the same shuffle of micro-batches
        trainer.ppo_train(0.0)
    assert len(seen["full"]) == len(seen["entropy"]) == B // 2
    by_batch = {mode: sorted(seen[mode], key=lambda t: t[0]) for mode in seen}
    for (ka, wa), (kb, wb) in zip(by_batch["full"], by_batch["entropy"]):
        assert ka == kb and torch.equal(wa, wb)
    assert any((w != 1.0).any() for _, w in seen["full"])


def test_batch_keys_are_the_replay_buffers_keys():
    """sample_keys (one reduction for the batch, used by the old-log-prob forward) gives each row the key the
    replay buffer's unpadded sample has, and the right padding remove_padding_in_sequences strips."""
    from openrlhf.trainer.ppo_utils.experience import remove_padding_in_sequences, split_experience_batch

    exp = _left_padded(base._experience(base._model()))
    exp.attention_mask[1, -3:] = 0  # more right padding on one row
    exp.sequences[1, -3:] = 0
    exp.action_mask[1, -3:] = False
    items = remove_padding_in_sequences(split_experience_batch(copy.deepcopy(exp)))
    keys = stats.sample_keys(exp.sequences, exp.attention_mask)
    assert len(keys) == B
    for b, item in enumerate(items):
        key, right = keys[b]
        assert stats.sample_key(item.sequences, item.attention_mask) == (key, 0)
        assert item.sequences.shape[0] == exp.sequences.shape[1] - right


def test_pad_rows_pads_each_row_to_the_width():
    rows = [torch.tensor([1.0, 2.0]), torch.tensor([3.0]), torch.tensor([4.0, 5.0, 6.0])]
    out = step.pad_rows(rows, 5, 1.0)
    want = torch.tensor([[1, 2, 1, 1, 1], [3, 1, 1, 1, 1], [4, 5, 6, 1, 1]], dtype=torch.float32)
    assert torch.equal(out, want)
    mask = step.pad_rows([torch.tensor([True, False]), torch.tensor([True])], 2, 0)
    assert mask.dtype == torch.bool and mask.tolist() == [[True, False], [True, False]]
