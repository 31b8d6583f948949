"""The named algorithms carry the settings their papers and this project's specification give."""
import pytest

from stare.algorithms import ALGORITHMS, TOKEN_RULES, BandGate, PaperGate, get_algorithm


def test_names():
    """Read off the registries, not a copy of them (a new algorithm or rule edits no test here): the arms the
    product compares are there; each named algorithm builds on its defaults under its own name and runs a
    registered token rule; "none" is the first rule, no rule is registered twice, and every other rule is some
    named algorithm's."""
    assert {"grpo", "dr-grpo", "dapo", "stare", "stare-c2", "stare-phi"} <= set(ALGORITHMS)
    used = set()
    for name in ALGORITHMS:
        cfg = get_algorithm(name)
        assert cfg.name == name and cfg.token_rule in TOKEN_RULES and cfg.rule.name == cfg.token_rule, name
        used.add(cfg.token_rule)
    assert TOKEN_RULES[0] == "none" and len(set(TOKEN_RULES)) == len(TOKEN_RULES)
    assert set(TOKEN_RULES) - {"none"} <= used


def test_the_entropy_controls_carry_their_sources_settings():
    """entropy-adaptive: TRL's use_adaptive_entropy defaults (coefficient from 0, delta 0.005 within [0, 1], target
    0.2) on Skywork-OR1's base as we read it; entropy-adv: Cheng et al.'s alpha 0.4, kappa 2 on GRPO's clip with a
    token-mean loss. Neither touches STARE's gate, and a bonus's settings are refused where they cannot act."""
    ada = get_algorithm("entropy-adaptive")
    assert (ada.entropy_adaptive, ada.entropy_coef, ada.entropy_coef_delta, ada.entropy_coef_min,
            ada.entropy_coef_max, ada.entropy_target) == (True, 0.0, 0.005, 0.0, 1.0, 0.2)
    assert (ada.clip_low, ada.clip_high, ada.dual_clip, ada.agg, ada.dynamic_sampling, ada.stare) == \
        (0.2, 0.2, None, "token-mean", True, False)
    assert ada.entropy_bonus and ada.needs_entropy and ada.make_controller() is None
    adv = get_algorithm("entropy-adv")
    assert (adv.token_rule, adv.entropy_adv_alpha, adv.entropy_adv_kappa) == ("entropy-adv", 0.4, 2.0)
    assert (adv.clip_low, adv.clip_high, adv.agg, adv.dynamic_sampling, adv.entropy_bonus) == \
        (0.2, 0.2, "token-mean", False, False)
    assert adv.rule.needs_entropy and not adv.rule.choice
    for name in ALGORITHMS:  # no other algorithm has a bonus
        assert get_algorithm(name).entropy_bonus == (name == "entropy-adaptive")
    # a static bonus on any algorithm; the adaptive one's range, and entropy-adv's settings elsewhere, refused
    assert get_algorithm("grpo", entropy_coef=0.01).make_entropy_coef().update(5.0) == 0.01
    with pytest.raises(ValueError, match="entropy_coef_max"):
        get_algorithm("entropy-adaptive", entropy_coef_min=0.5, entropy_coef_max=0.4)
    with pytest.raises(ValueError, match="entropy_coef"):
        get_algorithm("entropy-adaptive", entropy_coef=2.0)  # above entropy_coef_max 1
    with pytest.raises(ValueError, match="entropy_adv_kappa"):
        get_algorithm("entropy-adv", entropy_adv_kappa=1.0)  # kappa 1 would zero an A < 0 token at the bound
    with pytest.raises(ValueError, match="entropy_adv_alpha .* applies to token_rule entropy-adv only"):
        get_algorithm("grpo", entropy_adv_alpha=0.5)
    assert "entropy_target" in get_algorithm("grpo").unused_settings()
    assert "entropy_target" not in ada.unused_settings()


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
    with pytest.raises(ValueError, match=r"^band_low 0.5 must be at most band_high 0.4 \(the band gate"):
        get_algorithm("stare-phi", band_low=0.5, band_high=0.4)
    with pytest.raises(ValueError, match=r"^band_target must be in \[0.3, 0.45\]"):
        get_algorithm("stare-phi", band_target=0.5)
    with pytest.raises(ValueError, match="unknown aggregation"):
        get_algorithm("grpo", agg="sum")


def test_entropy_baselines_carry_the_papers_settings():
    """Clip-Cov / KL-Cov as the entropy paper's 7B scripts (verl recipe/entropy), 80/20 on DAPO's settings."""
    clip = get_algorithm("clip-cov")
    assert (clip.token_rule, clip.clip_ratio, clip.cov_low, clip.cov_high) == ("clip-cov", 2e-4, 1.0, 5.0)
    assert (clip.clip_low, clip.clip_high, clip.dual_clip, clip.agg) == (1.0, 1.0, None, "token-mean")
    assert clip.std_norm and clip.dynamic_sampling and not clip.overlong_shaping and not clip.stare
    assert not clip.unclipped and clip.make_controller() is None
    kl = get_algorithm("kl-cov")
    assert (kl.token_rule, kl.k_ratio, kl.kl_cov_coef, kl.agg, kl.dual_clip) == \
        ("kl-cov", 2e-3, 1.0, "token-mean", None)
    assert kl.unclipped and kl.std_norm and kl.dynamic_sampling and not kl.overlong_shaping
    top = get_algorithm("80-20")
    dapo = get_algorithm("dapo")
    for key in ("clip_low", "clip_high", "dual_clip", "agg", "dynamic_sampling", "overlong_shaping", "std_norm",
                "overlong_buffer_len", "overlong_penalty"):
        assert getattr(top, key) == getattr(dapo, key), key
    assert (top.token_rule, top.top_ratio, top.stare, top.unclipped) == ("80-20", 0.2, False, False)
    for name in ("clip-cov", "kl-cov", "80-20"):
        assert "2025" in ALGORITHMS[name].description
    # defaults of the new settings on every other algorithm: no token rule
    for name in ("grpo", "dr-grpo", "dapo", "stare", "stare-c2", "stare-phi"):
        cfg = get_algorithm(name)
        assert cfg.token_rule == "none" and not cfg.unclipped


def test_needs_entropy():
    assert get_algorithm("stare", telemetry="off").needs_entropy
    assert get_algorithm("80-20", telemetry="off").needs_entropy
    for name in ("grpo", "clip-cov", "kl-cov"):
        assert not get_algorithm(name, telemetry="off").needs_entropy
        assert get_algorithm(name, telemetry="entropy").needs_entropy
        assert get_algorithm(name).needs_entropy  # telemetry full


@pytest.mark.parametrize("overrides, message", [
    (dict(token_rule="clipcov"), "unknown token_rule 'clipcov'; valid choices: none, clip-cov, kl-cov, 80-20"),
    (dict(clip_ratio=0.0), "clip_ratio must be in \\(0, 1\\], got 0.0"),
    (dict(clip_ratio=1.5), "clip_ratio must be in \\(0, 1\\], got 1.5"),
    (dict(cov_high=0.5), "cov_high must be in \\(1.0, inf\\], got 0.5"),
    (dict(cov_low=float("nan")), "cov_low must be a number, got nan"),
    (dict(k_ratio=0.0), "k_ratio must be in \\(0, 1\\], got 0.0"),
    (dict(kl_cov_coef=-1.0), "kl_cov_coef must be in \\[0, inf\\], got -1.0"),
    (dict(clip_low=1.5), "clip_low must be in \\[0, 1\\], got 1.5"),
    (dict(stats_kernel="cuda"), "unknown stats_kernel 'cuda'; valid choices: auto, torch, triton, compiled, cpp"),
])
def test_baseline_settings_are_validated(overrides, message):
    with pytest.raises(ValueError, match=message):
        get_algorithm("clip-cov", **overrides)


def test_token_rules_are_exclusive_with_stare_and_80_20_needs_a_share():
    with pytest.raises(ValueError, match="token_rule 'kl-cov' .* cannot be combined with stare"):
        get_algorithm("stare", token_rule="kl-cov")
    with pytest.raises(ValueError, match="top_ratio must be in \\(0, 1\\], got 0.0"):
        get_algorithm("80-20", top_ratio=0.0)
    assert get_algorithm("grpo", token_rule="80-20", top_ratio=0.5).top_ratio == 0.5


def test_no_algorithm_setting_shadows_a_run_setting():
    """`--set key=value` must mean one thing: the presets reject a run setting named like an algorithm setting (the
    GPU presets' `kl_coef` is OpenRLHF's reference-model KL, hence KL-Cov's `kl_cov_coef`)."""
    from pathlib import Path

    import yaml

    from stare.algorithms import SETTING_NAMES
    from stare.cli.gpu_schema import SCHEMA

    run_keys = set(SCHEMA)
    for path in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"):
        run_keys |= set(yaml.safe_load(path.read_text()).get("settings") or {})
    assert "kl_coef" in run_keys and not set(SETTING_NAMES) & run_keys, set(SETTING_NAMES) & run_keys


def test_stare_step_runs_whatever_rule_the_name_looks_up(monkeypatch):
    """The step asks the rule object for its weights and penalty (and passes the generator): a rule registered under
    a name is what runs."""
    import torch

    from stare.algorithms import EntropyStats, TokenRule, stare_step
    from stare.algorithms.token_rules import RULES

    seen = {}

    class Halves(TokenRule):
        name = "clip-cov"
        active = True
        random = True

        def apply(self, cfg, logprobs, advantages, mask, entropy, *, group=None, generator=None):
            seen["generator"] = generator
            return torch.full(logprobs.shape, 0.5), torch.ones(logprobs.shape)

    monkeypatch.setitem(RULES, "clip-cov", Halves())
    cfg = get_algorithm("clip-cov", telemetry="off")
    gen = torch.Generator()
    lp = -torch.rand(2, 3)
    res = stare_step(None, cfg, lp, torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool),
                     EntropyStats(None, -lp, None), generator=gen)
    assert seen["generator"] is gen and torch.equal(res.weights, torch.full((2, 3), 0.5))
    assert torch.equal(res.penalty, torch.ones(2, 3)) and res.metrics == {"stare/tokens": 6.0}


def test_parse_algorithm_list_against_a_brute_force_check():
    """Every list of up to three names drawn from two algorithms and one unknown: accepted exactly when it names at
    least one algorithm, all of them known and none twice (a check written here from those rules)."""
    import itertools

    from stare.algorithms.registry import parse_algorithm_list

    pool = ["grpo", "stare", "ppo"]
    for n in range(0, 4):
        for names in itertools.product(pool, repeat=n):
            text = " , ".join(names)
            good = n > 0 and "ppo" not in names and len(set(names)) == n
            if good:
                assert parse_algorithm_list(text) == list(names)
            else:
                with pytest.raises(ValueError) as err:
                    parse_algorithm_list(text)
                said = str(err.value)
                if n == 0:
                    assert said.startswith("no algorithm named")
                elif "ppo" in names:
                    assert said.startswith("unknown algorithm 'ppo'; valid algorithms: grpo, ")
                else:
                    assert said == f"lists an algorithm twice: {text!r}"
