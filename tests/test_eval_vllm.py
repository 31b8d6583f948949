"""`stare eval --backend vllm` against the strict vLLM 0.29.0 stand-in (tests/vllm_standin.py; vLLM needs a GPU):
one request per problem with n = k, the tensor-parallel size and seeds passed through, the chat template applied
as on the HF backend, the same samples.jsonl and summary as the HF backend writes for the same tokens; no two
samples share a seed; over-long prompts and truncation are reported, not fatal; greedy k > 1 and out-of-range
temperatures are refused before any model loads."""
import importlib.util
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tiny_models import INSTRUCTION, PROBLEMS, build_tiny_model, write_problems
from vllm_standin import SamplingParams, VLLMValidationError, make_vllm, scripted

from stare.cli.main import app
from stare.eval import harness

K = 3
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    plain = build_tiny_model(tmp_path_factory.mktemp("boxed"), train=True)
    # the same weights with a chat template, to see that it is applied
    chat = tmp_path_factory.mktemp("chat")
    for f in plain.iterdir():
        (chat / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((chat / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|>"
    (chat / "tokenizer_config.json").write_text(json.dumps(cfg))
    # and a tokenizer that adds BOS when asked for special tokens (as Llama's does)
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(chat / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(chat / "tokenizer.json"))
    return plain, chat


def run_cli(*args):
    res = CliRunner().invoke(app, list(args))
    assert res.exit_code == 0, (res.output, res.exception)
    return res


def test_vllm_backend_matches_the_hf_path(model_dirs, tmp_path, monkeypatch):
    from transformers.generation.utils import GenerationMixin

    plain, _ = model_dirs
    data = write_problems(tmp_path / "mini.jsonl")
    # "\\boxed{2}" and "\\boxed{5}" are 5 tokens, "\\boxed{033}" 6: at 6 tokens the last is cut before its EOS
    common = ["eval", "--bench", "aime25", "--model", str(plain), "--data-file", str(data), "--k", str(K),
              "--max-tokens", "6", "--seed", "7"]
    generated = {}  # prompt ids -> the k rows of new tokens the HF model generated
    original = GenerationMixin.generate

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        prompt = kwargs["input_ids"][0].tolist()
        generated[tuple(prompt)] = out[:, len(prompt):].tolist()
        return out

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    run_cli(*common, "--backend", "hf", "--out", str(tmp_path / "hf"))
    monkeypatch.setattr(GenerationMixin, "generate", original)
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(plain).eos_token_id

    def replay(child):  # the stand-in's model emits the tokens the HF model sampled, up to and with its EOS
        for t in generated[tuple(child.prompt_ids)][child.index]:
            yield t
            if t == eos:
                return

    module, calls = make_vllm(replay)
    monkeypatch.setitem(sys.modules, "vllm", module)
    run_cli(*common, "--backend", "vllm", "--tp", "2", "--out", str(tmp_path / "vllm"))

    assert calls["llm"] == [{"model": str(plain), "tensor_parallel_size": 2, "seed": 7}]
    assert len(calls["generate"]) == len(PROBLEMS)  # one request per problem ...
    for prompts, (params,) in calls["generate"]:
        assert len(prompts) == 1  # ... holding one prompt with n = k samples
        assert (params.n, params.temperature, params.top_p, params.max_tokens) == (K, 1.0, 0.7, 6)
    # sample j of problem i draws from (7 mod 2**31) * 2**32 + i * K + j: every sample its own seed
    assert [c["seed"] for c in calls["samples"]] == [(7 << 32) + n for n in range(len(PROBLEMS) * K)]

    hf_rows = [json.loads(x) for x in (tmp_path / "hf" / "samples.jsonl").read_text().splitlines()]
    assert any(r["truncated"] for r in hf_rows) and not all(r["truncated"] for r in hf_rows)  # both kinds
    assert (tmp_path / "vllm" / "samples.jsonl").read_text() == (tmp_path / "hf" / "samples.jsonl").read_text()
    hf_sum = json.loads((tmp_path / "hf" / "summary.json").read_text())
    vllm_sum = json.loads((tmp_path / "vllm" / "summary.json").read_text())
    assert hf_sum.pop("backend") == "hf" and vllm_sum.pop("backend") == "vllm"
    hf_sum.pop("versions"), vllm_sum.pop("versions")
    assert vllm_sum == hf_sum
    # a sample is truncated when it has max_tokens tokens and no EOS among them
    assert hf_sum["truncated"] == pytest.approx(sum(r["num_tokens"] == 6 for r in hf_rows) / len(hf_rows))
    assert hf_sum["not_attempted"] == 0 and hf_sum["not_attempted_ids"] == []


def test_vllm_prompt_uses_the_chat_template_without_a_second_bos(model_dirs, monkeypatch, tmp_path):
    _, chat = model_dirs
    problem = PROBLEMS[0]
    expected = f"<|user|>{problem['problem']}\n{INSTRUCTION}<|assistant|>"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat)
    texts = ["\\boxed{2}", "\\boxed{5}", "\\boxed{2} and so on"]
    module, calls = make_vllm(scripted(tok, lambda prompt, j: texts[j], eos=True))
    monkeypatch.setitem(sys.modules, "vllm", module)
    backend = harness.make_backend("vllm", str(chat), tp=1, seed=0)
    prompt = backend.prompt_text(problem["problem"], INSTRUCTION)
    assert prompt == expected
    proto = harness.Protocol("stare", K, 1.0, 0.7, 6)
    got = backend.generate(prompt, K, proto, seed=5)
    n = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert n[0] < 6 and n[1] < 6 and n[2] > 6
    # in index order; the EOS id vLLM keeps is not counted; a sample cut at max_tokens counts every token
    assert got == [(texts[0], n[0], {"truncated": False}), (texts[1], n[1], {"truncated": False}),
                   (tok.decode(tok(texts[2], add_special_tokens=False)["input_ids"][:6]), 6, {"truncated": True})]
    (prompts, _), = calls["generate"]
    ids = prompts[0]["prompt_token_ids"]
    assert ids == backend.tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert backend.tokenizer("x")["input_ids"][0] == backend.tokenizer.bos_token_id  # it would add one ...
    assert backend.tokenizer.bos_token_id not in ids  # ... the template's text is sent as it is
    assert [c["seed"] for c in calls["samples"]] == [5, 6, 7]


def test_default_backend(monkeypatch):
    import torch

    module, _ = make_vllm(lambda child: iter(()))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", module)
    assert harness.default_backend() == "vllm"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert harness.default_backend() == "hf"  # importable but no GPU


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_missing_one_line_exit_2(tmp_path):
    data = write_problems(tmp_path / "mini.jsonl")
    res = subprocess.run([sys.executable, "-m", "stare.cli.main", "eval", "--bench", "aime24", "--model", "x/y",
                          "--data-file", str(data), "--backend", "vllm", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True)
    assert res.returncode == 2, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "--backend vllm needs the vllm package" in lines[0] and "use --backend hf" in lines[0]
    assert "Traceback" not in res.stderr and not (tmp_path / "o").exists()
