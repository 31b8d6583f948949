"""The plugin's collectives across two real processes (a gloo group on the CPU), against one process holding
every sample.

Two processes each build OpenRLHF 0.11.2's real ``ActorPPOTrainer`` with the plugin (tiny random Llama, as in
test_openrlhf_plugin.py) and split the step's 8 samples unevenly. Checked: every rank runs the same number of
forwards (ZeRO-3 lockstep) when they hold different numbers of samples; the all-reduced gate entropy and the
telemetry equal the single-process numbers; global-scope weights equal those of one process holding
everything; rows stashed by one rank's old-log-prob forward reach the rank that trains on the sample.
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

from stare.cli.openrlhf_backend import plugin  # noqa: E402

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
    trainer._stare_stash_clear()
    if stash:
        idx = torch.tensor(stash)
        trainer.stare_old_log_probs(exp.sequences[idx], exp.action_mask[idx], exp.attention_mask[idx])
    items = _items(exp)
    trainer.replay_buffer.items = [items[i] for i in buffer]
    forwards = []
    real = type(trainer.actor).forward
    trainer.actor.forward = lambda *a, **k: forwards.append(1) or real(trainer.actor, *a, **k)
    try:
        metrics = trainer.stare_prepare_step()
    finally:
        del trainer.actor.forward
    weights = {buffer[uid]: w.tolist() for uid, (w, _) in trainer._stare_rows.items()}
    return {"metrics": metrics, "forwards": len(forwards), "weights": weights,
            "report": dict(trainer.stare_stash_report)}


def _worker(rank, world, port, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mp = pytest.MonkeyPatch()
    try:
        settings = dict(SETTINGS)
        base._settings_env(mp, settings.pop("algo"), **settings)
        exp = base._experience(base._model())
        trainer = base._install(base._trainer(mp, base._model(), base._args()))
        results = {}
        for name, sc in SCENARIOS.items():
            results[name] = _run(trainer, exp, sc["stash"][rank], sc["buffer"][rank])
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
        settings = dict(SETTINGS)
        base._settings_env(mp, settings.pop("algo"), **settings)
        exp = base._experience(base._model())
        trainer = base._install(base._trainer(mp, base._model(), base._args()))
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
