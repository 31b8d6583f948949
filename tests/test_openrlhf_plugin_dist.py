"""The plugin's collectives across two real processes (a gloo group on the CPU), against one process holding
every sample.

Two processes each build the pinned OpenRLHF's real ``ActorPPOTrainer`` with the plugin (tiny random Llama, as in
test_openrlhf_plugin.py) and split the step's 8 samples unevenly. Checked: every rank runs the same number of
forwards (ZeRO-3 lockstep) when they hold different numbers of samples; the all-reduced gate entropy and the
telemetry equal the single-process numbers; global-scope weights equal those of one process holding
everything; rows stashed by one rank's old-log-prob forward reach the rank that trains on the sample; the entropy
baselines' token rules (telemetry off) select over both ranks what one process would (kl-cov, 80-20 exactly;
clip-cov's random draw per rank takes the same number of candidates).
"""
from __future__ import annotations

import copy
import os
import socket

import pytest
import torch

pytest.importorskip("openrlhf")
pytest.importorskip("deepspeed")
import test_openrlhf_plugin as base  # noqa: E402  (installs the flash-attn / vLLM stand-ins)
from openrlhf.trainer.ppo_utils.experience import remove_padding_in_sequences, split_experience_batch  # noqa: E402

from stare.cli.openrlhf_backend import plugin, stats  # noqa: E402

B = base.B
# (forward chunk: whose old-log-prob forward stashed which samples, buffer: who trains on which samples)
SCENARIOS = {
    # no stash at all: the extra pass, 5 vs 3 samples (3 vs 2 micro-batches of 2)
    "extra_pass": {"stash": ([], []), "buffer": ([0, 1, 2, 3, 4], [5, 6, 7])},
    # OpenRLHF's chunking, then dynamic batching re-deals the samples (5 vs 3): rows travel between ranks
    "redealt": {"stash": ([0, 1, 2, 3], [4, 5, 6, 7]), "buffer": ([0, 1, 4, 5, 6], [2, 3, 7])},
    # rank 1 misses two samples nobody stashed: it recomputes them, rank 0 pads for lockstep
    "partial": {"stash": ([0, 1, 2, 3], [4, 5]), "buffer": ([0, 1, 2, 3], [4, 5, 6, 7])},
}
SETTINGS = {"algo": "stare", "target_entropy": 100.0, "w": 2.0, "variant": "C2", "m": 0.5}


def _items(exp):
    return remove_padding_in_sequences(split_experience_batch(copy.deepcopy(exp)))


def _run(trainer, exp, stash, buffer):
    """Stash the given samples via the old-log-prob forward, fill the buffer, prepare the step."""
    trainer.stare.stash.clear()
    if stash:
        idx = torch.tensor(stash)
        trainer.stare.stash.old_log_probs(exp.sequences[idx], exp.action_mask[idx], exp.attention_mask[idx])
    items = _items(exp)
    trainer.replay_buffer.items = [items[i] for i in buffer]
    forwards = []
    real = type(trainer.actor).forward
    trainer.actor.forward = lambda *a, **k: forwards.append(1) or real(trainer.actor, *a, **k)
    try:
        metrics = trainer.stare.prepare_step()
    finally:
        del trainer.actor.forward
    weights = {buffer[uid]: w.tolist() for uid, (w, _) in trainer.stare.rows.items()}
    return {"metrics": metrics, "forwards": len(forwards), "weights": weights,
            "report": dict(trainer.stare.stash.report)}


def _plugin_trainer(mp):
    """(trainer with the plugin installed and SETTINGS applied, one experience batch), as every rank builds them."""
    settings = dict(SETTINGS)
    base._settings_env(mp, settings.pop("algo"), **settings)
    exp = base._experience(base._model())
    return base._install(base._trainer(mp, base._model(), base._args())), exp


def _worker(rank, world, port, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mp = pytest.MonkeyPatch()
    try:
        trainer, exp = _plugin_trainer(mp)
        results = {}
        for name, sc in SCENARIOS.items():
            results[name] = _run(trainer, exp, sc["stash"][rank], sc["buffer"][rank])
        results["baselines"] = {algo: _baseline_rows(mp, algo, BASELINE_SPLIT["stash"][rank],
                                                     BASELINE_SPLIT["buffer"][rank]) for algo in BASELINES}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        mp.undo()
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    torch.multiprocessing.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.fixture(scope="module")
def one_rank():
    mp = pytest.MonkeyPatch()
    try:
        trainer, exp = _plugin_trainer(mp)
        return _run(trainer, exp, [], list(range(B)))
    finally:
        mp.undo()


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_ranks_equal_one_process_holding_everything(two_ranks, one_rank, scenario):
    r0, r1 = two_ranks[0][scenario], two_ranks[1][scenario]
    ref = one_rank["metrics"]
    assert ref["stare/gate_on"] == 1.0
    for key, value in ref.items():
        for r in (r0, r1):
            assert r["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (scenario, key)
    # the whole step's selection over both ranks: exactly the single process's weights
    weights = {**r0["weights"], **r1["weights"]}
    assert sorted(weights) == list(range(B))
    assert any(w != 1.0 for row in weights.values() for w in row)
    for i in range(B):
        assert weights[i] == one_rank["weights"][i], (scenario, i)


def test_lockstep_every_rank_runs_the_same_number_of_forwards(two_ranks):
    got = {name: (two_ranks[0][name]["forwards"], two_ranks[1][name]["forwards"]) for name in SCENARIOS}
    assert got["extra_pass"] == (3, 3)  # 5 vs 3 samples, micro-batches of 2: the short rank pads once
    assert got["redealt"] == (0, 0)  # every row found on the other rank: no forward at all
    assert got["partial"] == (1, 1)  # rank 1 recomputes 2 samples, rank 0 pads
    assert [two_ranks[r]["redealt"]["report"]["exchanged"] for r in (0, 1)] == [3, 2]
    assert [two_ranks[r]["partial"]["report"]["recomputed"] for r in (0, 1)] == [0, 2]
    assert plugin.UID_KEY  # the module under test is the plugin


# ---- ring attention: each rank computes the statistics on its slice of the packed rows ----------------------


class _PositionalLogits(torch.nn.Module):
    """A model whose logits at a position depend only on that position's token and position id, so that a
    rank holding a slice of the packed sequence computes exactly what one process holding all of it would
    (ring attention's contract), without ring_flash_attn."""

    def __init__(self, vocab, max_pos):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.tok = torch.nn.Parameter(3 * torch.randn(vocab, vocab, generator=g))
        self.pos = torch.nn.Parameter(torch.randn(max_pos, vocab, generator=g))

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kw):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
        return {"logits": self.tok[input_ids] + self.pos[position_ids]}


def _flash_all_gather(input_, group):
    """flash_attn.utils.distributed.all_gather: concatenation of every rank's tensor along the first dim."""
    import torch.distributed as dist

    parts = [torch.empty_like(input_) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, input_.contiguous(), group=group)
    return torch.cat(parts, 0)


def _ring_worker(rank, world, port, out_dir):
    import einops
    import test_openrlhf_stash as stash_tests
    import torch.distributed as dist
    from openrlhf.models import Actor, ring_attn_utils

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(ring_attn_utils, "unpad_input", stash_tests._unpad_input)
        mp.setattr(ring_attn_utils, "pad_input", stash_tests._pad_input)
        mp.setattr(ring_attn_utils, "index_first_axis", lambda x, idx: x[idx])
        mp.setattr(ring_attn_utils, "rearrange", einops.rearrange)
        mp.setattr(ring_attn_utils, "all_gather", _flash_all_gather)
        mp.setattr(ring_attn_utils, "update_ring_attn_params", lambda cu_seqlens: None)
        base._settings_env(mp, "stare", target_entropy=100.0)
        exp = stash_tests._left_padded(base._experience(base._model()))
        args = base._args()
        args.ds.packing_samples = True
        trainer = base._install(base._trainer(mp, base._model(), args))
        model = _PositionalLogits(base.V, 64)
        trainer.actor = Actor(model, temperature=0.7)
        trainer.actor.packing_samples = True  # (set by Actor only when it loads the model itself)
        trainer.strategy.ring_attn_group = dist.group.WORLD
        assert int(exp.attention_mask.sum()) % world != 0  # the ring pads the packed sequence
        lp = trainer.stare.stash.old_log_probs(exp.sequences, exp.action_mask, exp.attention_mask)
        rows = {}
        for b in range(base.B):
            key, _ = stats.sample_key(exp.sequences[b], exp.attention_mask[b])
            _, ent, phi = trainer.stare.stash.rows[key]
            rows[b] = (ent.tolist(), phi.tolist())
        torch.save({"lp": lp, "rows": rows}, os.path.join(out_dir, f"ring{rank}.pt"))
        dist.barrier()
    finally:
        mp.undo()
        dist.destroy_process_group()


def test_ring_attention_slices_are_gathered_like_openrlhfs_log_probs(tmp_path):
    import test_openrlhf_stash as stash_tests

    torch.multiprocessing.spawn(_ring_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"ring{r}.pt") for r in range(2)]
    # the reference: one process, no packing, the same position ids; logits / temperature, brute force
    exp = stash_tests._left_padded(base._experience(base._model()))
    attn = exp.attention_mask
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = _PositionalLogits(base.V, 64)(exp.sequences, position_ids=pos)["logits"] / 0.7
    h, la, phi = stash_tests._stats_from_rows(logits[:, :-1][:, -base.RESP:], exp.sequences[:, 1:][:, -base.RESP:])
    mask = exp.action_mask
    for r in range(2):
        assert torch.allclose(got[r]["lp"].double() * mask, la * mask, atol=1e-5)  # OpenRLHF's own unpacking
        for b in range(base.B):
            n = int(mask[b].sum())
            ent_b, phi_b = got[r]["rows"][b]
            assert torch.allclose(torch.tensor(ent_b, dtype=torch.float64), h[b, :n], atol=1e-5), (r, b)
            assert torch.allclose(torch.tensor(phi_b, dtype=torch.float64), phi[b, :n], atol=1e-5), (r, b)


# ---- the entropy baselines: their token rules over both ranks equal one process holding everything -------------

BASELINES = {"kl-cov": {"k_ratio": 0.1, "kl_cov_coef": 2.0}, "clip-cov": {"clip_ratio": 0.2, "cov_low": 0.0},
             "80-20": {}}
# OpenRLHF's chunking stashes 4 + 4 samples, dynamic batching re-deals them 5 + 3 (80-20's entropy travels)
BASELINE_SPLIT = {"stash": ([0, 1, 2, 3], [4, 5, 6, 7]), "buffer": ([0, 1, 4, 5, 6], [2, 3, 7])}


def _baseline_rows(mp, algo, stash, buffer):
    """Telemetry off (the rules run anyway): (weights, coefficients) per sample index, and the metrics."""
    base._settings_env(mp, algo, telemetry="off", **BASELINES[algo])
    exp = base._experience(base._model())
    trainer = base._install(base._trainer(mp, base._model(), base._args()))
    if stash:
        idx = torch.tensor(stash)
        trainer.stare.stash.old_log_probs(exp.sequences[idx], exp.action_mask[idx], exp.attention_mask[idx])
    items = _items(exp)
    trainer.replay_buffer.items = [items[i] for i in buffer]
    metrics = trainer.stare.prepare_step()
    weights = {buffer[u]: None if w is None else w.tolist() for u, (w, _) in trainer.stare.rows.items()}
    coefs = {buffer[u]: c.tolist() for u, c in trainer.stare.penalty_rows.items()}
    return {"weights": weights, "coefs": coefs, "metrics": metrics, "report": dict(trainer.stare.stash.report)}


def test_baselines_select_over_both_ranks_as_one_process_would(two_ranks):
    import test_openrlhf_baselines as bl

    ranks = [two_ranks[r]["baselines"] for r in range(2)]
    mp = pytest.MonkeyPatch()
    try:
        one = {algo: _baseline_rows(mp, algo, [], list(range(B))) for algo in BASELINES}
    finally:
        mp.undo()
    both = {algo: {key: {**ranks[0][algo][key], **ranks[1][algo][key]} for key in ("weights", "coefs")}
            for algo in BASELINES}
    # kl-cov and 80-20 select exactly (a threshold over both ranks): the same tokens as one process
    assert both["kl-cov"]["coefs"] == one["kl-cov"]["coefs"] and len(one["kl-cov"]["coefs"]) == B
    assert any(c > 0 for row in one["kl-cov"]["coefs"].values() for c in row)
    assert both["80-20"]["weights"] == one["80-20"]["weights"]
    assert [r["80-20"]["report"]["exchanged"] for r in ranks] == [3, 2]  # the entropy rows travelled
    # clip-cov draws per rank: the same number of tokens over both ranks as one process, all among the candidates
    exp = base._experience(base._model())
    cand = bl._clip_cov_candidates(exp, 0.0, 5.0)

    def dropped(rows):
        return {(i, t) for i, row in rows.items() for t, w in enumerate(row) if w == 0.0}

    d_both, d_one = dropped(both["clip-cov"]["weights"]), dropped(one["clip-cov"]["weights"])
    assert len(d_both) == len(d_one) == min(max(1, int(0.2 * int(exp.action_mask.sum()))), int(cand.sum()))
    assert all(bool(cand[i, t]) for i, t in d_both)
    for algo in BASELINES:
        ref = one[algo]["metrics"]
        assert set(ranks[0][algo]["metrics"]) == set(ranks[1][algo]["metrics"]) == set(ref), algo
        for key, value in ref.items():
            for r in ranks:
                assert r[algo]["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (algo, key)
