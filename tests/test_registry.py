"""The named algorithms carry the settings the issue and the papers specify."""
import pytest

from stare.algorithms import ALGORITHMS, BandGate, PaperGate, get_algorithm


def test_names():
    assert list(ALGORITHMS) == ["grpo", "dr-grpo", "dapo", "stare", "stare-c2", "stare-phi"]


def test_baseline_settings():
    grpo = get_algorithm("grpo")
    assert (grpo.clip_low, grpo.clip_high, grpo.agg, grpo.std_norm, grpo.stare) == (0.2, 0.2, "seq-mean-token-mean", True, False)
    assert not grpo.dynamic_sampling and grpo.dual_clip is None
    dr = get_algorithm("dr-grpo")
    assert (dr.std_norm, dr.agg) == (False, "seq-mean-token-sum-norm")
    dapo = get_algorithm("dapo")
    assert (dapo.clip_low, dapo.clip_high, dapo.dual_clip, dapo.agg) == (0.2, 0.28, 10.0, "token-mean")
    assert dapo.dynamic_sampling and dapo.overlong_shaping and not dapo.stare
    assert dapo.make_controller() is None


def test_stare_is_grpo_ds_plus_o1():
    dapo, stare = get_algorithm("dapo"), get_algorithm("stare")
    for key in ("clip_low", "clip_high", "dual_clip", "agg", "dynamic_sampling", "std_norm"):
        assert getattr(stare, key) == getattr(dapo, key), key
    assert not stare.overlong_shaping
    assert (stare.variant, stare.top_ratio, stare.w, stare.selection, stare.controller) == ("O1", 0.1, 1.1, "quantile", "paper")
    gate = stare.make_controller()
    assert isinstance(gate, PaperGate) and gate.target_entropy == 0.3 and not gate.adaptive
    assert get_algorithm("stare-c2").variant == "C2" and get_algorithm("stare-c2").m == 0.9
    phi = get_algorithm("stare-phi")
    assert phi.selection == "phi" and phi.needs_phi and isinstance(phi.make_controller(), BandGate)


def test_overrides_and_errors():
    assert get_algorithm("stare", w=1.05, m=0.95).w == 1.05
    with pytest.raises(ValueError, match="unknown algorithm 'ppo'; valid algorithms: grpo, dr-grpo"):
        get_algorithm("ppo")
    with pytest.raises(ValueError, match="unknown algorithm setting 'wx'; valid settings: std_norm"):
        get_algorithm("stare", wx=1.0)
    with pytest.raises(ValueError, match="target_entropy must be in \\(0"):
        get_algorithm("stare", target_entropy=-1.0)
    with pytest.raises(ValueError, match="band low must be <= band high"):
        get_algorithm("stare-phi", band_low=0.5, band_high=0.4)
    with pytest.raises(ValueError, match="unknown aggregation"):
        get_algorithm("grpo", agg="sum")
