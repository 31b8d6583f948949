"""stare.algorithms.token_rules (algorithms/token_rules.py): the registry of token rules (``RULES``,
``get_token_rule``, ``TOKEN_RULES``), ``register_token_rule``'s refusals, ``STARE_TOKEN_RULE_MODULES`` and the rules'
own checks (``validate``). The rules' maths: tests/test_baselines.py, test_delight_gate.py, test_steer.py; a rule
registered from outside the package, run as docs/architecture.md writes it: tests/test_token_rule_plugin.py."""
import pytest

from stare.algorithms import ALGORITHMS, TOKEN_RULES, TokenRule, get_algorithm, get_token_rule, register_token_rule
from stare.algorithms import token_rules


def test_token_rules_are_a_registry_that_everything_asks():
    """Each rule says what it reads, needs and changes; AlgoConfig's properties and both engines ask the rule."""
    from stare.algorithms import SETTING_NAMES, get_token_rule
    from stare.algorithms.token_rules import RULES

    assert tuple(RULES) == TOKEN_RULES
    for name, rule in RULES.items():
        assert rule.name == name and get_token_rule(name) is rule
        assert set(rule.exclusive) <= set(rule.settings) <= set(SETTING_NAMES), name
        assert rule.active == (name != "none")
    assert [n for n, r in RULES.items() if r.unclipped] == ["kl-cov"]
    assert [n for n, r in RULES.items() if r.random] == ["clip-cov"]
    assert [n for n, r in RULES.items() if r.needs_entropy] == ["80-20", "entropy-adv", "steer"]
    assert [n for n, r in RULES.items() if not r.choice] == ["entropy-adv", "dg", "steer"]  # weights scale, not choose
    for name, cfg in ALGORITHMS.items():
        assert cfg.rule is RULES[cfg.token_rule] and cfg.unclipped == cfg.rule.unclipped, name
    with pytest.raises(ValueError, match="unknown token_rule 'clipcov'; valid choices: none, clip-cov"):
        get_token_rule("clipcov")


def test_a_missing_module_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(token_rules.MODULES_ENV, "no_such_rules_module")
    with pytest.raises(ImportError, match="STARE_TOKEN_RULE_MODULES: cannot import token-rule module "
                                          "'no_such_rules_module'"):
        get_token_rule("nonexistent")
    monkeypatch.delenv(token_rules.MODULES_ENV)
    with pytest.raises(ValueError, match="unknown token_rule 'nonexistent'; valid choices: none, clip-cov"):
        get_token_rule("nonexistent")


def test_the_decorator_refuses_duplicates_nameless_rules_and_non_rules():
    class Again(TokenRule):
        name = "clip-cov"

    class Nameless(TokenRule):
        pass

    class Spaced(TokenRule):
        name = " spaced"

    before = dict(token_rules.RULES)
    with pytest.raises(ValueError, match="token rule 'clip-cov' is already registered \\(ClipCov\\)"):
        register_token_rule(Again)
    with pytest.raises(ValueError, match="needs a name of its own"):
        register_token_rule(Nameless)  # inherits "none": refused, never replaces the base rule
    with pytest.raises(ValueError, match="needs a name of its own"):
        register_token_rule(Spaced)
    with pytest.raises(ValueError, match="takes a subclass of TokenRule"):
        register_token_rule(object)
    assert token_rules.RULES == before


@pytest.fixture
def registry_restored():
    """Rules registered in a test are taken out again afterwards."""
    saved = dict(token_rules.RULES)
    yield
    token_rules.RULES.clear()
    token_rules.RULES.update(saved)


def test_a_registered_rule_joins_the_live_list_of_names(registry_restored):
    before = tuple(TOKEN_RULES)

    @register_token_rule
    class Every(TokenRule):
        name = "every-token"
        active = True

    assert tuple(TOKEN_RULES) == before + ("every-token",)  # read live, after the built-in rules
    assert len(TOKEN_RULES) == len(before) + 1 and TOKEN_RULES[-1] == "every-token" and "every-token" in TOKEN_RULES
    assert TOKEN_RULES == list(before) + ["every-token"] and TOKEN_RULES != before
    assert isinstance(get_token_rule("every-token"), Every)
    again = register_token_rule(Every)  # the same class again: allowed, one entry
    assert again is Every and list(TOKEN_RULES).count("every-token") == 1
    with pytest.raises(TypeError):
        hash(TOKEN_RULES)  # it compares by value and changes: not hashable


def test_get_token_rule_refuses_what_is_not_a_registered_name():
    for name in ("Clip-Cov", "", None, 3):
        with pytest.raises(ValueError, match=f"^unknown token_rule {name!r}; valid choices: none, clip-cov, kl-cov, "
                                             "80-20, entropy-adv, dg, steer"):
            get_token_rule(name)


def test_steer_linear_mapping_needs_weight_max_above_weight_min():
    cfg = get_algorithm("steer", steer_mapping="linear", steer_weight_min=0.2, steer_weight_max=0.9)
    assert (cfg.steer_weight_min, cfg.steer_weight_max) == (0.2, 0.9)
    for top in (0.2, 0.1):
        with pytest.raises(ValueError, match=f"^steer_weight_max {top!r} must be > steer_weight_min 0.2 with "
                                             "steer_mapping linear"):
            get_algorithm("steer", steer_mapping="linear", steer_weight_min=0.2, steer_weight_max=top)
    # exp reads weight_min only, in (0, 1): a weight_max below it is not its concern
    assert get_algorithm("steer", steer_weight_min=0.5, steer_weight_max=0.1).steer_weight_min == 0.5
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError, match=r"steer_weight_min must be in \(0, 1\)"):
            get_algorithm("steer", steer_weight_min=bad)

