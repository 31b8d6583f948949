"""`stare eval --backend vllm` against a stand-in `vllm` module (vLLM needs a GPU): one request per problem with
n = k, the tensor-parallel size and seeds passed through, the chat template applied as on the HF backend, and the
same samples.jsonl and summary as the HF backend writes for the same responses."""
import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import types
from dataclasses import dataclass, field

import pytest
from typer.testing import CliRunner

from tiny_models import INSTRUCTION, PROBLEMS, build_tiny_model, write_problems

from stare.cli.main import app
from stare.eval import harness

K = 3
MAX_TOKENS = 12


@dataclass
class Completion:  # vllm.outputs.CompletionOutput, the fields the backend reads
    index: int
    text: str
    token_ids: list
    finish_reason: str
    stop_reason: object = None


@dataclass
class RequestOutput:  # vllm.outputs.RequestOutput
    prompt_token_ids: list
    outputs: list = field(default_factory=list)


def fake_vllm(answers):
    """A `vllm` module whose LLM records its calls and answers each prompt (as decoded text) from ``answers``:
    prompt text -> [(response text, number of generated tokens before EOS)]."""
    calls = {"llm": [], "generate": []}

    class SamplingParams:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class LLM:
        def __init__(self, model, **kwargs):
            from transformers import AutoTokenizer

            calls["llm"].append({"model": model, **kwargs})
            self.tokenizer = AutoTokenizer.from_pretrained(model)

        def get_tokenizer(self):
            return self.tokenizer

        def generate(self, prompts, sampling_params, use_tqdm=True):
            calls["generate"].append((prompts, sampling_params.kwargs))
            out = []
            for prompt in prompts:
                ids = prompt["prompt_token_ids"]
                text = self.tokenizer.decode(ids)
                canned = answers[text][: sampling_params.kwargs["n"]]
                eos = self.tokenizer.eos_token_id
                outputs = [Completion(j, t, list(range(10, 10 + n)) + [eos], "stop")  # vLLM keeps the EOS id
                           if n < MAX_TOKENS else Completion(j, t, list(range(10, 10 + n)), "length")
                           for j, (t, n) in enumerate(canned)]
                out.append(RequestOutput(ids, outputs[::-1]))  # out of order: the backend sorts by index
            return out

    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.LLM, module.SamplingParams = LLM, SamplingParams
    return module, calls


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
    plain, _ = model_dirs
    data = write_problems(tmp_path / "mini.jsonl")
    common = ["eval", "--bench", "aime25", "--model", str(plain), "--data-file", str(data), "--k", str(K),
              "--max-tokens", str(MAX_TOKENS), "--seed", "7"]
    run_cli(*common, "--backend", "hf", "--out", str(tmp_path / "hf"))
    hf_rows = [json.loads(x) for x in (tmp_path / "hf" / "samples.jsonl").read_text().splitlines()]
    # what the stand-in answers: the HF run's responses, keyed by the prompt the HF backend builds
    answers = {f"{p['problem']}\n{INSTRUCTION}": [(r["response"], r["num_tokens"]) for r in hf_rows
                                                    if r["problem_id"] == p["id"]] for p in PROBLEMS}
    module, calls = fake_vllm(answers)
    monkeypatch.setitem(sys.modules, "vllm", module)
    run_cli(*common, "--backend", "vllm", "--tp", "2", "--out", str(tmp_path / "vllm"))

    assert calls["llm"] == [{"model": str(plain), "tensor_parallel_size": 2, "seed": 7}]
    assert len(calls["generate"]) == len(PROBLEMS)  # one request per problem ...
    seeds = []
    for (prompts, params), p in zip(calls["generate"], PROBLEMS):
        assert len(prompts) == 1  # ... holding one prompt with n = k samples
        assert {k: params[k] for k in ("n", "temperature", "top_p", "max_tokens")} == \
            {"n": K, "temperature": 1.0, "top_p": 0.7, "max_tokens": MAX_TOKENS}
        seeds.append(params["seed"])
    assert seeds == [7 * 1_000_003 + i for i in range(len(PROBLEMS))]  # the HF backend's per-problem seeds

    assert (tmp_path / "vllm" / "samples.jsonl").read_text() == (tmp_path / "hf" / "samples.jsonl").read_text()
    hf_sum = json.loads((tmp_path / "hf" / "summary.json").read_text())
    vllm_sum = json.loads((tmp_path / "vllm" / "summary.json").read_text())
    assert hf_sum.pop("backend") == "hf" and vllm_sum.pop("backend") == "vllm"
    hf_sum.pop("versions"), vllm_sum.pop("versions")
    assert vllm_sum == hf_sum


def test_vllm_prompt_uses_the_chat_template_without_a_second_bos(model_dirs, monkeypatch, tmp_path):
    _, chat = model_dirs
    problem = PROBLEMS[0]
    expected = f"<|user|>{problem['problem']}\n{INSTRUCTION}<|assistant|>"
    module, calls = fake_vllm({expected: [("\\boxed{2}", 4), ("\\boxed{5}", 4), ("\\boxed{2}", MAX_TOKENS)]})
    monkeypatch.setitem(sys.modules, "vllm", module)
    backend = harness.make_backend("vllm", str(chat), tp=1, seed=0)
    prompt = backend.prompt_text(problem["problem"], INSTRUCTION)
    assert prompt == expected
    got = backend.generate(prompt, K, harness.PROTOCOLS["stare"], seed=5)
    # in index order; the EOS id vLLM keeps is not counted, a sample cut at max_tokens counts every token
    assert got == [("\\boxed{2}", 4), ("\\boxed{5}", 4), ("\\boxed{2}", MAX_TOKENS)]
    (prompts, _), = calls["generate"]
    ids = prompts[0]["prompt_token_ids"]
    assert ids == backend.tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert backend.tokenizer("x")["input_ids"][0] == backend.tokenizer.bos_token_id  # it would add one ...
    assert backend.tokenizer.bos_token_id not in ids  # ... the template's text is sent as it is


def test_default_backend(monkeypatch):
    import torch

    module, _ = fake_vllm({})
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
