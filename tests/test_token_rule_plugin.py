"""A token rule registered from outside the package: docs/architecture.md's worked example, run as written.

The example module is cut out of the docs and imported by name through ``STARE_TOKEN_RULE_MODULES`` (as the CLI
and OpenRLHF's workers import it); its weights are checked against a sort by hand, then in the local engine's
loss and in OpenRLHF's trainer with the plugin (the gradient equal to OpenRLHF's own loss with the weights folded
into the advantages). The decorator's refusals and a missing module: tests/test_token_rules.py.
"""
from __future__ import annotations

import copy
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from stare.algorithms import TOKEN_RULES, get_algorithm, get_token_rule
from stare.algorithms import token_rules

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
NAME = "top-surprisal"


def example_source() -> str:
    text = DOC.read_text()
    section = text[text.index("## A token rule from outside the package"):]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks and blocks[0].startswith("# my_rules.py\n"), "the worked example's code block moved"
    return blocks[0]


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """The docs' module on sys.path as ``my_rules``, named in STARE_TOKEN_RULE_MODULES; the registry restored after."""
    (tmp_path / "my_rules.py").write_text(example_source())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(token_rules.MODULES_ENV, "my_rules")
    saved, imported = dict(token_rules.RULES), set(token_rules._imported)
    yield
    token_rules.RULES.clear()
    token_rules.RULES.update(saved)
    token_rules._imported.clear()
    token_rules._imported.update(imported)
    sys.modules.pop("my_rules", None)


def brute_force(logprobs, mask, share):
    """1 on the ceil(share * n) response tokens of highest surprisal (and any tied with the last), else 0."""
    flat = [(-float(logprobs[i, j]), i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]]
    flat.sort(reverse=True)
    k = max(1, math.ceil(share * len(flat)))
    cut = flat[k - 1][0]
    out = torch.zeros(mask.shape)
    for s, i, j in flat:
        if s >= cut:
            out[i, j] = 1.0
    return out


def test_the_rule_is_found_by_name_through_the_variable_and_validates(plugin_module):
    assert "my_rules" not in sys.modules and NAME not in token_rules.RULES
    rule = get_token_rule(NAME)  # imports my_rules
    assert "my_rules" in sys.modules and rule.name == NAME and rule.active
    assert NAME in TOKEN_RULES and TOKEN_RULES[-1] == NAME
    cfg = get_algorithm("dapo", token_rule=NAME, top_ratio=0.25)
    assert cfg.rule is rule and not cfg.unclipped
    with pytest.raises(ValueError, match="cannot be combined with stare"):
        get_algorithm("stare", token_rule=NAME)
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 5, generator=g) * 4
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    weights, penalty = rule.apply(cfg, logprobs, torch.ones(3), mask, None)
    assert penalty is None and torch.equal(weights, brute_force(logprobs, mask, 0.25))
    assert int(weights.sum()) == math.ceil(0.25 * 13)


def test_the_local_engine_trains_with_it(plugin_module, tmp_path, monkeypatch):
    from test_local_baselines import _one_step

    t, rec, steps, losses = _one_step("dapo", tmp_path / "run", tmp_path / "warm", monkeypatch,
                                      f"token_rule={NAME}", "top_ratio=0.3")
    [(_, micros, step)] = steps
    assert step.weights is not None and step.penalty is None
    # the step's own inputs, recovered from the loss calls: old log-probs and mask of every sample
    width = step.weights.shape[1]
    old = torch.zeros(step.weights.shape)
    mask = torch.zeros(step.weights.shape, dtype=torch.bool)
    for (_, o, _, m, kw, _), micro in zip(losses, micros):
        assert torch.equal(kw["weights"], step.weights[micro])
        old[micro, :o.shape[1]], mask[micro, :m.shape[1]] = o.float(), m.bool()
    assert old.shape[1] == width
    want = brute_force(old, mask, 0.3)
    assert torch.equal(step.weights * mask, want)
    assert 0 < rec["stare/masked_share"] < 1
    assert rec["stare/masked_share"] == pytest.approx(1 - float(want.sum()) / float(mask.sum()))


def test_the_openrlhf_plugin_trains_with_it(plugin_module, monkeypatch):
    pytest.importorskip("openrlhf")
    pytest.importorskip("deepspeed")
    import test_openrlhf_plugin as P

    args = P._args()
    exp = P._experience(P._model())
    P._settings_env(monkeypatch, "dapo", token_rule=NAME, top_ratio=0.3)
    model = P._model()
    ours = P._install(P._trainer(monkeypatch, model, args, gas=P.B // 2))
    ours.replay_buffer.append(copy.deepcopy(exp))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    status = ours.ppo_train(0.0)
    weights = brute_force(exp.action_log_probs, exp.action_mask, 0.3)
    assert 0 < weights.sum() < exp.action_mask.sum()
    assert status["stare/masked_share"] == pytest.approx(1 - float(weights.sum()) / float(exp.action_mask.sum()))
    # OpenRLHF's own loss over the whole batch with the weights folded into the advantages
    ref_model = P._model()
    ref = P._trainer(monkeypatch, ref_model, args)
    folded = copy.deepcopy(exp)
    folded.advantages = exp.advantages * weights
    n_tok = exp.action_mask.sum().float()
    ref.training_step(folded, 0.0, 0, {"dp_size": 1, "batch_num_tokens": n_tok, "global_batch_size": float(P.B)})
    assert torch.allclose(P._grads(model), P._grads(ref_model), rtol=1e-5, atol=1e-7)
