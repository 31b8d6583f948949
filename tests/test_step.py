"""stare_step, the once-per-step block both engines run, against computations written out here by hand.

Selections are brute force (sort the set, take the top ceil(P n), ties at the threshold included), means and
shares are Python sums over token lists, and the controller's decision is the published rule written out. The
two-process test runs the real collectives (gloo, CPU) and checks the union of both ranks' tokens.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from stare.algorithms import (
    LEGACY_NAMES,
    METRIC_NAMES,
    EntropyStats,
    StepMemory,
    batch_mean,
    get_algorithm,
    masked_mean,
    metrics_markdown,
    stare_step,
    upgrade_metric_names,
)


# ---- a batch and the hand computations ---------------------------------------------------------------------
def _batch(B=6, T=9, seed=0, per_token=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    # log-probs rounded to 0.1: ties at the selection threshold happen
    logp = (-torch.rand(B, T, generator=g) * 3).mul(10).round().div(10)
    entropy = torch.rand(B, T, generator=g) * 1.5
    phi = torch.randn(B, T, generator=g) * 0.3
    adv_seq = torch.tensor([1.0, -0.5, 0.0, 2.0, -1.0, 0.7, -0.3, 1.2][:B])
    adv = adv_seq[:, None] * torch.rand(B, T, generator=g) if per_token else adv_seq
    return logp, adv, mask, EntropyStats(entropy, -logp, phi)


def _tokens(logp, adv, mask, stats, weights=None, penalty=None):
    """One dict per response token (row-major), plain Python numbers (``c``: the KL-Cov coefficient, 0 unset)."""
    B, T = logp.shape
    adv_tok = adv[:, None].expand(B, T) if adv.dim() == 1 else adv
    out = []
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                out.append({"row": i, "col": t, "s": -float(logp[i, t]), "a": float(adv_tok[i, t]),
                            "h": float(stats.entropy[i, t]), "sur": float(stats.surprisal[i, t]),
                            "phi": float(stats.phi[i, t]), "w": 1.0 if weights is None else float(weights[i, t]),
                            "c": 0.0 if penalty is None else float(penalty[i, t])})
    return out


def _top(tokens, key, ratio):
    """The tokens among ``tokens`` whose key is at or above the ceil(ratio * n)-th largest (at least 1)."""
    if not tokens or ratio <= 0:
        return []
    k = min(len(tokens), max(1, math.ceil(round(ratio * len(tokens), 9))))
    threshold = sorted((key(t) for t in tokens), reverse=True)[k - 1]
    return [t for t in tokens if key(t) >= threshold]


def _brute_weights(logp, adv, mask, stats, cfg, w, m, damp):
    """The selection rules of cfg (quantile O1/C2 by surprisal, or the Phi-sign rule with damping)."""
    weights = torch.ones(logp.shape)
    toks = _tokens(logp, adv, mask, stats)
    pos = [t for t in toks if t["a"] > 0]
    neg = [t for t in toks if t["a"] < 0]
    if cfg.selection == "quantile":
        chosen_pos = _top(pos, lambda t: t["s"], cfg.top_ratio)
        chosen_neg = _top(neg, lambda t: t["s"], cfg.top_ratio) if cfg.variant == "C2" else []
    else:
        chosen_pos = [t for t in pos if t["phi"] > 0]
        chosen_neg = [t for t in neg if t["phi"] > 0] if cfg.variant == "C2" else []
    for t in chosen_pos:
        weights[t["row"], t["col"]] = w
    for t in chosen_neg:
        weights[t["row"], t["col"]] = m
    if damp != 1.0:
        for t in pos:
            if t["phi"] < 0:
                weights[t["row"], t["col"]] = damp
    return weights


def _hand_metrics(toks, penalised=False):
    n = len(toks)
    pos = [t for t in toks if t["a"] > 0]
    neg = [t for t in toks if t["a"] < 0]
    active = len(pos) + len(neg)
    out = {
        "stare/entropy": sum(t["h"] for t in toks) / n,
        "stare/tokens": float(n),
        "stare/entropy_forecast": sum(t["w"] * t["a"] * t["phi"] for t in toks) / n,
        "stare/entropy_forecast_base": sum(t["a"] * t["phi"] for t in toks) / n,
        "stare/positive_reweight_ratio": sum(t["w"] != 1.0 for t in pos) / max(len(pos), 1),
        "stare/negative_reweight_ratio": sum(t["w"] != 1.0 for t in neg) / max(len(neg), 1),
        "stare/mean_weight": sum(t["w"] for t in toks) / n,
    }
    cells = {"pos_low": lambda t: t["a"] > 0 and t["sur"] <= t["h"], "pos_high": lambda t: t["a"] > 0 and t["sur"] > t["h"],
             "neg_low": lambda t: t["a"] < 0 and t["sur"] <= t["h"], "neg_high": lambda t: t["a"] < 0 and t["sur"] > t["h"]}
    for q, inside in cells.items():
        out[f"stare/{q}_share"] = sum(map(inside, toks)) / active
        out[f"stare/{q}_contrib"] = sum(t["a"] * t["phi"] for t in toks if inside(t)) / n
    boosted = [t for t in toks if t["w"] > 1]
    if boosted:
        out["stare/boosted_phi_pos_share"] = sum(t["phi"] > 0 for t in boosted) / len(boosted)
    lowered = [t for t in toks if t["w"] < 1 or t["c"] > 0]
    if lowered:
        out["stare/lowered_phi_pos_share"] = sum(t["phi"] > 0 for t in lowered) / len(lowered)
    out["stare/masked_share"] = sum(t["w"] == 0 for t in toks) / n
    if penalised:
        out["stare/penalised_share"] = sum(t["c"] > 0 for t in toks) / n
    return out


def _controller_by_hand(cfg, h):
    """(gate_on, W, M, damp) for batch entropy h, written out from the two rules."""
    if cfg.controller == "paper":
        return h < cfg.target_entropy, cfg.w, cfg.m, 1.0
    target = cfg.band_high if cfg.band_target is None else cfg.band_target
    s = min(1.0, cfg.gain * (target - h) / (target - cfg.band_low)) if h < target else 0.0
    return s > 0, 1 + s * (cfg.w - 1), 1 - s * (1 - cfg.m), 1 - s * (1 - cfg.damp)


def _same_weights(got, expected):
    """The same tokens reweighted, by the same factors (the controller's W, M in float32 vs float64 by hand)."""
    return torch.equal(got != 1, expected != 1) and torch.allclose(got, expected, rtol=1e-6, atol=0)


def _check(metrics, hand, rel=1e-5):
    for key, value in hand.items():
        assert metrics[key] == pytest.approx(value, rel=rel, abs=1e-7), key
    assert set(metrics) <= set(METRIC_NAMES), set(metrics) - set(METRIC_NAMES)


# ---- one process --------------------------------------------------------------------------------------------
CASES = [
    ("stare", {"target_entropy": 5.0}, False),  # paper O1, per-sequence advantages
    ("stare-c2", {"target_entropy": 5.0, "top_ratio": 0.25}, True),  # C2, per-token advantages
    ("stare-phi", {"band_low": 0.5, "band_high": 1.2}, True),  # Phi-sign rule, damping, band gate (partial strength)
]


@pytest.mark.parametrize("algo, overrides, per_token", CASES)
def test_global_step_against_brute_force(algo, overrides, per_token):
    cfg = get_algorithm(algo, **overrides)
    logp, adv, mask, stats = _batch(per_token=per_token)
    h = sum(t["h"] for t in _tokens(logp, adv, mask, stats)) / int(mask.sum())
    gate_on, w, m, damp = _controller_by_hand(cfg, h)
    assert gate_on
    result = stare_step(cfg.make_controller(), cfg, logp, adv, mask, stats)
    expected = _brute_weights(logp, adv, mask, stats, cfg, w, m, damp)
    assert _same_weights(result.weights, expected)
    assert (result.weights[mask] != 1).any() and result.weights[~mask].eq(1).all()
    assert result.metrics["stare/gate_on"] == 1.0
    if cfg.controller == "band":  # the entropy lies inside the band: a partial strength, W and damp scaled to 1
        assert 0 < result.metrics["stare/strength"] < 1 and 1 < w < cfg.w
    assert (result.metrics["stare/w"], result.metrics["stare/m"], result.metrics["stare/damp"]) == \
        pytest.approx((w, m, damp))
    _check(result.metrics, _hand_metrics(_tokens(logp, adv, mask, stats, expected)))
    assert "stare/entropy_change" not in result.metrics  # a first step has no previous one
    assert result.memory == StepMemory(result.metrics["stare/entropy"], result.metrics["stare/entropy_forecast"])
    # one process: the batch entropy is exactly masked_mean's
    assert result.metrics["stare/entropy"] == float(masked_mean(stats.entropy, mask))


def test_gate_off_and_baseline_give_no_weights():
    logp, adv, mask, stats = _batch()
    hand = _hand_metrics(_tokens(logp, adv, mask, stats))  # every weight 1
    cfg = get_algorithm("stare", target_entropy=1e-3)  # the batch entropy is far above: gate off
    off = stare_step(cfg.make_controller(), cfg, logp, adv, mask, stats)
    assert off.weights is None and off.metrics["stare/gate_on"] == 0.0
    _check(off.metrics, hand)
    assert off.metrics["stare/entropy_forecast"] == off.metrics["stare/entropy_forecast_base"]
    base_cfg = get_algorithm("grpo")
    base = stare_step(None, base_cfg, logp, adv, mask, stats)
    assert base.weights is None and base.state is None and "stare/gate_on" not in base.metrics
    _check(base.metrics, hand)
    with pytest.raises(ValueError, match="algorithm 'grpo' takes no controller"):
        stare_step(cfg.make_controller(), base_cfg, logp, adv, mask, stats)
    with pytest.raises(ValueError, match="algorithm 'stare' needs controller"):
        stare_step(None, cfg, logp, adv, mask, stats)


def test_entropy_change_is_against_the_previous_step():
    cfg = get_algorithm("stare", target_entropy=5.0)
    ctl = cfg.make_controller()
    first_batch, second_batch = _batch(seed=1), _batch(seed=2, B=5, T=7)
    first = stare_step(ctl, cfg, *first_batch)
    second = stare_step(ctl, cfg, *second_batch, memory=first.memory)
    h1 = sum(t["h"] for t in _tokens(*first_batch)) / int(first_batch[2].sum())
    h2 = sum(t["h"] for t in _tokens(*second_batch)) / int(second_batch[2].sum())
    weights1 = _brute_weights(*first_batch, cfg, cfg.w, cfg.m, 1.0)
    forecast1 = _hand_metrics(_tokens(*first_batch, weights1))["stare/entropy_forecast"]
    assert second.metrics["stare/entropy_change"] == pytest.approx(h2 - h1, rel=1e-5)
    assert second.metrics["stare/entropy_change_forecast"] == pytest.approx(forecast1, rel=1e-5)
    assert ctl.steps == 2  # one controller update per call


def test_micro_batch_scope_selects_inside_the_given_micro_batches():
    cfg = get_algorithm("stare-c2", target_entropy=5.0, scope="micro_batch", top_ratio=0.2)
    logp, adv, mask, stats = _batch(B=8, T=9, seed=3)
    micro = [torch.tensor([5, 0, 7]), torch.tensor([2, 6]), torch.tensor([1, 4, 3])]  # shuffled, uneven
    result = stare_step(cfg.make_controller(), cfg, logp, adv, mask, stats, micro_batches=micro)
    expected = torch.ones(logp.shape)
    for rows in micro:
        sub = EntropyStats(*(x[rows] for x in stats))
        expected[rows] = _brute_weights(logp[rows], adv[rows], mask[rows], sub, cfg, cfg.w, cfg.m, 1.0)
    assert torch.equal(result.weights, expected)
    # the selection depends on the split: the same rows in consecutive blocks give other weights
    blocks = [torch.arange(0, 3), torch.arange(3, 5), torch.arange(5, 8)]
    other = stare_step(cfg.make_controller(), cfg, logp, adv, mask, stats, micro_batches=blocks)
    assert not torch.equal(other.weights, result.weights)
    _check(result.metrics, _hand_metrics(_tokens(logp, adv, mask, stats, expected)))
    # without the micro-batches the engine selects later: no weights, no weight-dependent telemetry
    later = stare_step(cfg.make_controller(), cfg, logp, adv, mask, stats)
    assert later.weights is None and later.metrics["stare/gate_on"] == 1.0
    assert not {"stare/mean_weight", "stare/entropy_forecast"} & set(later.metrics)
    assert later.memory.forecast is None
    # scope global ignores micro_batches
    g = get_algorithm("stare-c2", target_entropy=5.0, top_ratio=0.2)
    assert torch.equal(stare_step(g.make_controller(), g, logp, adv, mask, stats, micro_batches=micro).weights,
                       _brute_weights(logp, adv, mask, stats, g, g.w, g.m, 1.0))


def test_bad_input_names_the_problem():
    cfg = get_algorithm("stare", target_entropy=5.0, scope="micro_batch")
    logp, adv, mask, stats = _batch()
    with pytest.raises(ValueError, match=r"phi has shape \(6, 8\) but logprobs has shape \(6, 9\)"):
        stare_step(cfg.make_controller(), cfg, logp, adv, mask, stats._replace(phi=stats.phi[:, :8]))
    with pytest.raises(ValueError, match="micro_batches must hold every row index 0..5 exactly once"):
        stare_step(cfg.make_controller(), cfg, logp, adv, mask, stats, micro_batches=[torch.tensor([0, 1, 1])])
    with pytest.raises(ValueError, match="stats must be an EntropyStats"):
        stare_step(cfg.make_controller(), cfg, logp, adv, mask, (stats.entropy, stats.phi))
    with pytest.raises(ValueError, match=r"logprobs must be shaped \[B, T\]"):
        stare_step(cfg.make_controller(), cfg, logp[0], adv, mask, stats)
    bad = stats._replace(entropy=stats.entropy.clone().index_put_((torch.tensor(0), torch.tensor(0)),
                                                                   torch.tensor(float("nan"))))
    with pytest.raises(FloatingPointError, match="batch entropy is nan"):
        stare_step(cfg.make_controller(), cfg, logp, adv, mask, bad)


def test_old_metric_names_read_as_the_new_ones(tmp_path):
    old = {"step": 3, "entropy": 0.5, "entropy_change": -0.01, "entropy_forecast": -0.02,
           "quadrant/pos_low_share": 0.4, "quadrant/neg_high_contrib": -0.003, "reward_mean": 0.7}
    new = upgrade_metric_names(old)
    assert new == {"step": 3, "stare/entropy": 0.5, "stare/entropy_change_same_batch": -0.01,
                   "stare/entropy_forecast": -0.02, "stare/pos_low_share": 0.4, "stare/neg_high_contrib": -0.003,
                   "reward_mean": 0.7}
    assert set(LEGACY_NAMES.values()) <= set(METRIC_NAMES)
    # a new-format record is left alone
    assert upgrade_metric_names(new) == new
    # and a run folder written before the rename reads through load_run
    from stare.cli.report.runs import load_run, run_measures

    run = tmp_path / "old"
    run.mkdir()
    (run / "config.yaml").write_text("algo: {name: grpo}\nsettings: {seed: 0}\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({**old, "step": s, "entropy": h}) + "\n"
                                               for s, h in ((1, 0.8), (2, 0.6))))
    loaded = load_run(run)
    assert [r["stare/entropy"] for r in loaded.metrics] == [0.8, 0.6] and "entropy" not in loaded.metrics[0]
    assert run_measures(loaded)["start_entropy"] == 0.8


def test_the_renamed_boosted_share_reads_under_its_new_name():
    assert upgrade_metric_names({"stare/boosted_raise_share": 0.25, "step": 1}) == \
        {"stare/boosted_phi_pos_share": 0.25, "step": 1}
    both = {"stare/boosted_raise_share": 0.25, "stare/boosted_phi_pos_share": 0.5}
    assert upgrade_metric_names(both) == {"stare/boosted_phi_pos_share": 0.5}
    assert "stare/boosted_raise_share" not in METRIC_NAMES


def test_boosted_and_lowered_shares_count_every_response_token():
    """M > 1 boosts A < 0 tokens too; damping lowers A > 0 tokens: both shares cover any advantage sign."""
    logp, adv, mask, stats = _batch(B=8, T=9, seed=6, per_token=True)
    cfg = get_algorithm("stare-c2", target_entropy=5.0, top_ratio=0.3, m=1.2)
    result = stare_step(cfg.make_controller(), cfg, logp, adv, mask, stats)
    toks = _tokens(logp, adv, mask, stats, result.weights)
    assert any(t["w"] > 1 and t["a"] < 0 for t in toks)
    hand = _hand_metrics(toks)
    assert "stare/lowered_phi_pos_share" not in hand and "stare/lowered_phi_pos_share" not in result.metrics
    _check(result.metrics, hand)
    phi = get_algorithm("stare-phi", band_low=0.5, band_high=1.2)
    result = stare_step(phi.make_controller(), phi, logp, adv, mask, stats)
    hand = _hand_metrics(_tokens(logp, adv, mask, stats, result.weights))
    assert hand["stare/lowered_phi_pos_share"] < 1  # damped tokens have Phi < 0
    _check(result.metrics, hand)


@pytest.mark.parametrize("algo, overrides", [("grpo", {}), ("dr-grpo", {}), ("dapo", {}),
                                             *((a, o) for a, o, _ in CASES)])
def test_existing_algorithms_draw_no_random_numbers(algo, overrides):
    cfg = get_algorithm(algo, **overrides)
    logp, adv, mask, stats = _batch(seed=7)
    g = torch.Generator().manual_seed(123)
    state, global_state = g.get_state(), torch.get_rng_state()
    with_gen = stare_step(cfg.make_controller(), cfg, logp, adv, mask, stats, generator=g)
    assert torch.equal(g.get_state(), state) and torch.equal(torch.get_rng_state(), global_state)
    without = stare_step(cfg.make_controller(), cfg, logp, adv, mask, stats)
    assert with_gen.metrics == without.metrics and with_gen.penalty is None
    assert (with_gen.weights is None) == (without.weights is None)
    if with_gen.weights is not None:
        assert torch.equal(with_gen.weights, without.weights)
    assert with_gen.metrics["stare/masked_share"] == 0.0


def test_clip_cov_draws_from_the_given_generator_only():
    logp, adv, mask, stats = _batch(B=8, T=9, seed=8)
    cfg = get_algorithm("clip-cov", clip_ratio=0.1, cov_low=-1.0, cov_high=1.0)
    g = torch.Generator().manual_seed(5)
    state, global_state = g.get_state(), torch.get_rng_state()
    first = stare_step(None, cfg, logp, adv, mask, stats, generator=g)
    assert not torch.equal(g.get_state(), state) and torch.equal(torch.get_rng_state(), global_state)
    again = stare_step(None, cfg, logp, adv, mask, stats, generator=torch.Generator().manual_seed(5))
    assert torch.equal(first.weights, again.weights) and first.metrics == again.metrics
    assert first.metrics["stare/masked_share"] == pytest.approx(int((first.weights == 0).sum()) / int(mask.sum()))


def test_every_telemetry_name_the_plugin_docs_list_is_a_metric():
    """docs/openrlhf-backend.md's plugin telemetry list names only keys of METRICS (one list, documented once)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "openrlhf-backend.md").read_text()
    start = page.index("- Telemetry under `train/stare/`")
    paragraph = page[start:page.index("\n- ", start + 1)]
    named = set(re.findall(r"`([a-z_]+)`", paragraph))
    assert {"entropy", "gate_on", "entropy_change", "entropy_change_same_batch"} <= named
    assert {f"stare/{n}" for n in named} <= set(METRIC_NAMES), {f"stare/{n}" for n in named} - set(METRIC_NAMES)
    table = metrics_markdown().splitlines()
    assert len(table) == 2 + len(METRIC_NAMES) and all(f"`{n}`" in "\n".join(table) for n in METRIC_NAMES)


def test_batch_mean_is_masked_mean():
    logp, adv, mask, stats = _batch()
    assert batch_mean(stats.entropy, mask) == float(masked_mean(stats.entropy, mask))
    assert batch_mean(stats.entropy, torch.zeros_like(mask)) == 0.0


# ---- two processes, real collectives ---------------------------------------------------------------------------
TWO_RANK_CASES = [CASES[1], CASES[2]]  # quantile C2 (radix select over ranks) and the Phi-sign rule (band gate)


def _rank_main(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for case, (algo, overrides, per_token) in enumerate(TWO_RANK_CASES):
            cfg = get_algorithm(algo, **overrides)
            logp, adv, mask, stats = _batch(B=8, T=9, seed=4, per_token=per_token)
            rows = slice(0, 3) if rank == 0 else slice(3, 8)  # uneven shares of the batch
            shard = (logp[rows], adv[rows], mask[rows], EntropyStats(*(x[rows] for x in stats)))
            result = stare_step(cfg.make_controller(), cfg, *shard, group=dist.group.WORLD)
            torch.save({"weights": result.weights, "metrics": result.metrics},
                       os.path.join(out_dir, f"case{case}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.cpu_only  # the ranks are CPU processes over gloo; their batch comes from the CPU generator
def test_two_ranks_are_exact_over_the_union(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for case, (algo, overrides, per_token) in enumerate(TWO_RANK_CASES):
        parts = [torch.load(tmp_path / f"case{case}-rank{r}.pt") for r in (0, 1)]
        cfg = get_algorithm(algo, **overrides)
        logp, adv, mask, stats = _batch(B=8, T=9, seed=4, per_token=per_token)
        h = sum(t["h"] for t in _tokens(logp, adv, mask, stats)) / int(mask.sum())
        gate_on, w, m, damp = _controller_by_hand(cfg, h)
        assert gate_on
        expected = _brute_weights(logp, adv, mask, stats, cfg, w, m, damp)
        assert _same_weights(torch.cat([p["weights"] for p in parts]), expected), algo
        hand = _hand_metrics(_tokens(logp, adv, mask, stats, expected))
        for p in parts:  # both ranks log the same numbers, exact over all 8 sequences
            _check(p["metrics"], hand)
        assert parts[0]["metrics"] == parts[1]["metrics"]


# ---- the settings an algorithm's settings make inert (AlgoConfig.unused_settings; stare run --sweep refuses them) --
# a valid value other than every algorithm's own for each setting unused_settings may name
_OTHER_VALUE = {"selection": "phi", "variant": "C2", "top_ratio": 0.3, "w": 1.7, "m": 0.6, "damp": 0.5, "phi_cap": 0.5,
                "phi_tol": 0.05, "scope": "micro_batch", "controller": "band", "target_entropy": 0.9, "adaptive": True,
                "alpha": 0.05, "w_max": 2.5, "m_min": 0.3, "band_low": 0.2, "band_high": 2.0, "band_target": 0.4,
                "gain": 2.0, "two_sided": True, "entropy_target": 0.9, "entropy_coef_delta": 0.01,
                "entropy_coef_min": 0.1, "entropy_coef_max": 0.5}
# the gates held open on _batch (entropy about 0.75), so the weights are there to differ
_OPEN = {"stare": {"target_entropy": 5.0}, "stare-c2": {"target_entropy": 5.0},
         "stare-phi": {"band_low": 0.5, "band_high": 1.2}}


def _three_steps(cfg, logp, adv, mask, stats):
    controller, coef, memory, out = cfg.make_controller(), cfg.make_entropy_coef(), None, []
    for _ in range(3):  # the adaptive gate's W and M move from step to step
        r = stare_step(controller, cfg, logp, adv, mask, stats, memory=memory, generator=torch.Generator().manual_seed(1),
                       entropy_coef=coef)
        memory = r.memory
        out.append((r.weights, r.penalty, r.metrics))
    return out


@pytest.mark.parametrize("algo", ["grpo", "dapo", "stare", "stare-c2", "stare-phi", "clip-cov", "kl-cov", "80-20",
                                  "entropy-adaptive", "entropy-adv", "dg", "steer"])
def test_an_unused_setting_changes_no_weight_and_no_number(algo):
    from stare.algorithms import ALGORITHMS

    base = get_algorithm(algo, **_OPEN.get(algo, {}))
    unused = base.unused_settings()
    assert unused and set(unused) <= set(_OTHER_VALUE)
    logp, adv, mask, stats = _batch(per_token=True)
    reference = _three_steps(base, logp, adv, mask, stats)
    if base.stare:
        assert reference[0][0] is not None  # the gate is open: there are weights to change
    for name in unused:
        assert getattr(base, name) != _OTHER_VALUE[name], name
        changed = _three_steps(get_algorithm(algo, **_OPEN.get(algo, {}), **{name: _OTHER_VALUE[name]}),
                               logp, adv, mask, stats)
        for (w0, p0, m0), (w1, p1, m1) in zip(reference, changed):
            assert (w0 is None) == (w1 is None) and (w0 is None or torch.equal(w0, w1)), name
            assert (p0 is None) == (p1 is None) and (p0 is None or torch.equal(p0, p1)), name
            echo = f"stare/{name}"  # the controller's state logs M as it stands, used or not
            assert {k: v for k, v in m0.items() if k != echo} == {k: v for k, v in m1.items() if k != echo}, name
    # and W, which every STARE algorithm uses, changes its weights (the comparison above can fail)
    if base.stare:
        changed = _three_steps(get_algorithm(algo, **_OPEN[algo], w=_OTHER_VALUE["w"]), logp, adv, mask, stats)
        assert not torch.equal(reference[0][0], changed[0][0])
    # and the adaptive bonus's target, which entropy-adaptive uses, moves its coefficient (batch entropy about 0.75)
    if base.entropy_adaptive:
        assert [m["stare/entropy_coef"] for _, _, m in reference] == [0.0, 0.0, 0.0]  # above 0.2: held at 0
        changed = _three_steps(get_algorithm(algo, entropy_target=0.9), logp, adv, mask, stats)
        assert [m["stare/entropy_coef"] for _, _, m in changed] == pytest.approx([0.005, 0.010, 0.015], abs=1e-12)


def test_each_token_rule_logs_exactly_the_numbers_it_declares():
    """For every algorithm with a token rule, on a batch where every share has tokens to count: of the names any rule
    declares (``TokenRule.telemetry``), the step logs exactly its own rule's, each a finite number (shares in
    [0, 1]) and each a line of METRICS; a rule's ``telemetry_sums`` returning a name it did not declare (or
    another rule's), or a declaration it never logs, fails here."""
    from stare.algorithms import ALGORITHMS
    from stare.algorithms.token_rules import RULES

    declared = {"stare/" + m.name: rule.name for rule in RULES.values() for m in rule.telemetry}
    assert declared and set(declared) <= set(METRIC_NAMES)
    ruled = {algo: get_algorithm(algo).rule for algo in ALGORITHMS if get_algorithm(algo).rule.active}
    assert {r.name for r in ruled.values()} >= set(declared.values())  # every declaring rule runs here
    logp, adv, mask, stats = _batch(per_token=True)
    for algo, rule in ruled.items():
        cfg = get_algorithm(algo, **_OPEN.get(algo, {}))
        metrics = stare_step(cfg.make_controller(), cfg, logp, adv, mask, stats,
                             generator=torch.Generator().manual_seed(1)).metrics
        own = set(metrics) - (set(METRIC_NAMES) - set(declared))  # all but the names every algorithm may log
        assert own == {"stare/" + m.name for m in rule.telemetry}, (algo, own)
        for k in own:
            assert math.isfinite(metrics[k]) and (not k.endswith("_share") or 0 <= metrics[k] <= 1), (algo, k)
