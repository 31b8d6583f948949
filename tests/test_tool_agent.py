"""The tool-use loop, the OpenRLHF agent file and `stare eval --tools python`.

The agent is driven by scripted model turns (no model). OpenRLHF's own executor and experience builder are run
on what the agent returns, to check that tool output never becomes an action token. The end-to-end eval uses a
tiny Llama fitted here for a few seconds to write one code block and then answer.
"""
import asyncio
import json
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from stare.cli.agent.loop import (TOOL_INSTRUCTION, ToolConfig, ToolEpisode, chat_format,
                                  format_for, observation_body, parse_action, plain_format)
from stare.cli.agent.sandbox import SandboxResult, isolation_report
from tiny_models import INSTRUCTION, PROBLEMS, build_tiny_model, write_problems

NS = isolation_report()["namespaces"]
# the tool loop asks for namespaces (its default) where the machine has them, else for the fallback; USED is the
# isolation the calls then run with
ISOLATION, USED = ("namespaces", "namespaces") if NS else ("auto", "basic")

AGENT_FILE = str(Path(__file__).resolve().parents[1] / "stare_cli" / "agent" / "python_agent.py")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def code(src: str) -> str:
    return f"Let me compute.\n```python\n{src}\n```"


@pytest.fixture(autouse=True)
def sandbox_isolation(monkeypatch):
    """What the agent and `stare eval --tools` read (STARE_SANDBOX_ISOLATION): namespaces here when there are some."""
    monkeypatch.setenv("STARE_SANDBOX_ISOLATION", ISOLATION)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The tiny BPE tokenizer (no chat template) and a copy with a ChatML template and its special tokens."""
    from transformers import AutoTokenizer

    folder = build_tiny_model(tmp_path_factory.mktemp("tok"))
    plain = AutoTokenizer.from_pretrained(folder)
    chat = AutoTokenizer.from_pretrained(folder)
    chat.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    chat.chat_template = CHATML
    return plain, chat


# --------------------------------------------------------------------------------------------------
# the pure loop
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, kind, payload", [
    (code("print(1)") + "\nthen\n```python\nprint(2)\n```\nwait", "code", "print(2)\n"),  # the last block
    ("```py\nx = 3\n```", "code", "x = 3\n"),
    (code("print(1)") + "\nSo the answer is \\boxed{7}.", "answer", "7"),  # an answer after the code
    ("The answer is \\boxed{7}. Let me check:\n```python\nprint(7)\n```", "code", "print(7)\n"),  # code after it
    ("```python\nprint(1)\n", "none", None),  # an unclosed block is not run
    ("I am not sure.", "none", None),
    ("```output\n\\boxed{3}\n```", "answer", "3"),
])
def test_parse_action(text, kind, payload):
    act = parse_action(text)
    assert act.kind == kind
    assert (act.code if kind == "code" else act.answer) == payload


def test_observation_body_cuts_and_names_the_failure():
    res = SandboxResult(stdout="a" * 5000, stderr="", error_kind="timeout", error="ran longer than 1 s")
    body = observation_body(res, 300)
    assert len(body) <= 300 and body.endswith("[tool error: timeout: ran longer than 1 s]") and "cut" in body
    assert observation_body(SandboxResult(exit_code=0), 300) == "(no output)"
    res = SandboxResult(stdout="1\n", stderr="Traceback ...\nValueError: bad", error_kind="exception",
                        error="ValueError: bad")
    assert observation_body(res, 300) == "1\nTraceback ...\nValueError: bad"


def test_plain_wrap_continues_the_text():
    fmt = plain_format()
    assert fmt.wrap("4", action_text="```python\nprint(4)\n```") == "\n```output\n4\n```\n"
    # the model opened the output block itself (stop string kept in the text): only the rest is added
    assert fmt.wrap("4", action_text="```python\nprint(4)\n```\n```output") == "\n4\n```\n"
    assert fmt.stop_strings == ["```output"]


def test_chat_format_is_read_off_the_template(tokenizers):
    plain, chat = tokenizers
    assert chat_format(plain) is None and format_for(plain).kind == "plain"
    fmt = chat_format(chat)
    assert (fmt.kind, fmt.turn_end, fmt.prefix, fmt.suffix) == (
        "chat", "<|im_end|>", "\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    wrapped = fmt.wrap("4", ended_turn=True)
    assert wrapped == "\n<|im_start|>user\n```output\n4\n```<|im_end|>\n<|im_start|>assistant\n"
    assert fmt.wrap("4", ended_turn=False) == "<|im_end|>" + wrapped  # a turn cut before its end token
    assert fmt.stop_strings == []
    with pytest.raises(ValueError, match="no usable chat template"):
        format_for(plain, "chat")


def fake_runner(outputs):
    """A stand-in sandbox returning canned results, recording the code it was given."""
    calls = []

    def run(src, **kw):
        calls.append((src, kw))
        return outputs.pop(0)

    run.calls = calls
    return run


def test_episode_ends_on_answer_and_scores_the_answer_turn_only():
    runner = fake_runner([SandboxResult(stdout="\\boxed{99}\n", exit_code=0)])
    ep = ToolEpisode(config=ToolConfig(max_turns=4), fmt=plain_format(), runner=runner)
    fb = ep.step(code("print('\\\\boxed{99}')"))
    assert "\\boxed{99}" in fb and not ep.done
    assert ep.step("So it is \\boxed{12}.") == "" and ep.done and ep.done_reason == "answer"
    assert ep.score("12") == 1.0 and ep.score("99") == 0.0  # the tool's box is not the model's answer
    assert ep.summary() == {"turns": 2, "tool_calls": 1, "tool_errors": 0, "done_reason": "answer"}


def test_turn_limit_and_budget_end_the_episode():
    runner = fake_runner([SandboxResult(stdout="1\n", exit_code=0)] * 5)
    ep = ToolEpisode(config=ToolConfig(max_turns=2), fmt=plain_format(), runner=runner)
    assert ep.step(code("print(1)")) != ""
    assert ep.step(code("print(1)")) == "" and ep.done_reason == "max_turns"
    assert len(runner.calls) == 1 and ep.score("1") == 0.0
    ep = ToolEpisode(config=ToolConfig(max_turns=5), fmt=plain_format(), runner=runner)
    assert ep.step(code("print(1)"), budget_left=0) == "" and ep.done_reason == "token_budget"
    ep = ToolEpisode(fmt=plain_format(), runner=runner)
    assert ep.step("no idea") == "" and ep.done_reason == "no_action"


def test_tool_config_from_env(monkeypatch):
    monkeypatch.setenv("STARE_TOOL_MAX_TURNS", "6")
    monkeypatch.setenv("STARE_TOOL_TIMEOUT_S", "2.5")
    monkeypatch.delenv("STARE_SANDBOX_ISOLATION")
    cfg = ToolConfig.from_env()
    assert (cfg.max_turns, cfg.timeout_s, cfg.memory_mb, cfg.isolation) == (6, 2.5, 1024, "namespaces")
    monkeypatch.setenv("STARE_SANDBOX_ISOLATION", "auto")
    assert ToolConfig.from_env().isolation == "auto"  # the fallback only when asked for
    monkeypatch.setenv("STARE_SANDBOX_ISOLATION", "docker")
    with pytest.raises(ValueError, match="STARE_SANDBOX_ISOLATION must be auto, namespaces or basic, got 'docker'"):
        ToolConfig.from_env()
    monkeypatch.delenv("STARE_SANDBOX_ISOLATION")
    monkeypatch.setenv("STARE_TOOL_MAX_TURNS", "many")
    with pytest.raises(ValueError, match="STARE_TOOL_MAX_TURNS must be an integer"):
        ToolConfig.from_env()
    monkeypatch.setenv("STARE_TOOL_MAX_TURNS", "0")
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        ToolConfig.from_env()


# --------------------------------------------------------------------------------------------------
# the OpenRLHF agent, driven by scripted turns
# --------------------------------------------------------------------------------------------------


def run_async(coro):
    return asyncio.run(coro)


@pytest.fixture
def agent_cls(monkeypatch):
    monkeypatch.setenv("STARE_TOOL_TIMEOUT_S", "1")
    monkeypatch.setenv("STARE_TOOL_MAX_TURNS", "4")
    from stare.cli.agent.python_agent import PythonToolAgent

    return PythonToolAgent


def drive(agent, turns, label):
    states = run_async(agent.reset({"observation": "PROMPT", "label": label}))
    assert states == {"observation": "PROMPT"}
    results = []
    for text in turns:
        res = run_async(agent.step({"observation_text": "PROMPT", "action_text": text, "label": label,
                                    "sampling_params": None}))
        assert set(res) == {"rewards", "scores", "environment_feedback", "done", "extra_logs"}
        results.append(res)
        if res["done"]:
            break
    return results


def test_correct_answer_after_two_tool_turns_scores_one(agent_cls):
    agent = agent_cls()
    res = drive(agent, [code("print(12 * 12)"), code("print(144 - 100)"), "So the answer is \\boxed{144}."], "144")
    assert [r["done"] for r in res] == [False, False, True]
    assert "```output\n144\n```" in res[0]["environment_feedback"] and "44" in res[1]["environment_feedback"]
    assert [r["rewards"].item() for r in res] == [0.0, 0.0, 1.0]  # OpenRLHF sums them: 1 in all
    assert res[-1]["scores"].item() == 1.0 and res[-1]["environment_feedback"] == ""
    assert res[-1]["extra_logs"] == {"tool_turns": 3.0, "tool_calls": 2.0, "tool_errors": 0.0, "tool_answered": 1.0,
                                     "tool_sandbox_namespaces": float(NS)}
    agent = agent_cls()
    res = drive(agent, [code("print(12 * 12)"), "It is \\boxed{145}."], "144")
    assert sum(r["rewards"].item() for r in res) == 0.0 and res[-1]["done"]


def test_the_isolation_each_sample_used_is_logged(monkeypatch):
    """extra_logs' tool_sandbox_namespaces: 1.0 for a sample whose tool calls ran in the namespaces (the default; a
    sample without a call gets what its sandbox was set to), 0.0 for the fallback, asked for with basic here."""
    from stare.cli.agent.python_agent import PythonToolAgent

    monkeypatch.setenv("STARE_SANDBOX_ISOLATION", "basic")
    res = drive(PythonToolAgent(), [code("print(6 * 7)"), "\\boxed{42}"], "42")
    assert res[0]["environment_feedback"].startswith("\n```output\n42") and res[-1]["rewards"].item() == 1.0
    assert res[-1]["extra_logs"]["tool_sandbox_namespaces"] == 0.0
    if NS:
        monkeypatch.setenv("STARE_SANDBOX_ISOLATION", "namespaces")
        assert drive(PythonToolAgent(), ["\\boxed{42}"], "42")[-1]["extra_logs"]["tool_sandbox_namespaces"] == 1.0


ATTACKS = {
    "malformed code": ("print((1, 2)\n", "SyntaxError"),
    "exception": ("raise ValueError('nope')", "ValueError: nope"),
    "timeout": ("while True:\n    pass", "[tool error: timeout"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", "[tool error: blocked: sandbox: starting processes"),
    "subprocess bomb": ("import subprocess\nwhile True:\n    subprocess.Popen(['sleep', '60'])",
                        "[tool error: blocked: sandbox: starting processes"),
    "memory hog": ("x = bytearray(10 * 1024**3)", "[tool error: memory"),
    "socket": ("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
               "[tool error: blocked: sandbox: network access is disabled"),
    "write outside": ("open('/tmp/outside-file', 'w').write('x')",
                      "[tool error: blocked: sandbox: writing outside the scratch directory"),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_bad_tool_calls_give_a_tool_error_and_the_episode_goes_on(agent_cls, name):
    src, expected = ATTACKS[name]
    agent = agent_cls()
    res = drive(agent, [code(src), code("print(6 * 7)"), "\\boxed{42}"], "42")
    fb = res[0]["environment_feedback"]
    assert fb.startswith("\n```output\n") and expected in fb and not res[0]["done"]
    assert res[0]["extra_logs"]["tool_errors"] == 1.0
    assert "```output\n42\n```" in res[1]["environment_feedback"]  # the next call works: nothing was broken
    assert res[-1]["done"] and res[-1]["rewards"].item() == 1.0
    assert not Path("/tmp/outside-file").exists()


# --------------------------------------------------------------------------------------------------
# OpenRLHF's executor and experience builder on the agent's output: the action mask
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def openrlhf_loaders(monkeypatch):
    """OpenRLHF's agent loader and experience builder, importable here with stand-ins for vLLM (test process
    only) - the real ones need CUDA."""

    def stub(name, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)

    class SamplingParams:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    stub("vllm", SamplingParams=SamplingParams, __version__="0.29.0")
    stub("vllm.inputs", TokensPrompt=dict)
    stub("vllm.utils", random_uuid=lambda: "0")
    for mod in [m for m in sys.modules if m.startswith(("openrlhf.trainer",))]:
        monkeypatch.delitem(sys.modules, mod)
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from openrlhf.trainer.ray.vllm_engine import _load_agent_executor

    return _load_agent_executor, SamplesGenerator, SamplingParams


class ScriptedEngine:
    """Stands in for OpenRLHF's rollout actor: each generate() returns the next scripted turn as token ids."""

    def __init__(self, tok, turns, eos=False):
        self.tok, self.turns, self.eos, self.params = tok, list(turns), eos, []

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        self.params.append(sampling_params)
        text = self.turns.pop(0)
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + ([self.tok.convert_tokens_to_ids("<|im_end|>")]
                                                                        if self.eos else [])
        out = SimpleNamespace(token_ids=ids, text=text, finish_reason="stop", logprobs=None)
        return SimpleNamespace(outputs=[out])


@pytest.mark.parametrize("chat", [False, True])
def test_tool_output_tokens_are_not_actions(openrlhf_loaders, tokenizers, monkeypatch, capsys, chat):
    load, SamplesGenerator, SamplingParams = openrlhf_loaders
    monkeypatch.setenv("STARE_TOOL_MAX_TURNS", "4")
    tok = tokenizers[1] if chat else tokenizers[0]
    executor = load(AGENT_FILE)  # exactly what --train.agent_func_path does
    # the rollout actor's log says which isolation its sandbox got
    logged = capsys.readouterr().out
    assert f"stare tool agent: sandbox isolation {USED} (STARE_SANDBOX_ISOLATION={ISOLATION})" in logged
    turns = [code("print(2 ** 10)"), code("print(1024 + 1)"), "Answer: \\boxed{1025}"]
    engine = ScriptedEngine(tok, turns, eos=chat)
    prompt = "What is 2**10 + 1?\n"
    params = SamplingParams(max_tokens=None, logprobs=None, stop=None)
    out = asyncio.run(executor.execute(prompt, "1025", params, 4096, tok, engine))
    assert out["reward"] == 1.0 and out["scores"] == 1.0 and out["extra_logs"]["tool_calls"] == 2.0
    stops = [getattr(p, "stop", None) for p in engine.params]
    assert stops == ([None] * 3 if chat else [["```output"]] * 3)  # plain text stops where an output block opens

    exp = SamplesGenerator._process_response_into_experience(None, out, max_len=4096)
    # the agent's extra logs become per-sample tensors, logged as train/<key>: the sandbox's isolation among them
    assert exp.info["tool_sandbox_namespaces"].tolist() == [float(NS)] and exp.info["tool_calls"].tolist() == [2.0]
    seq = exp.sequences[0].tolist()
    mask = [0] + exp.action_mask[0].tolist()  # OpenRLHF's mask is shifted by one (it scores token t from t-1)
    assert len(mask) == len(seq)
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert mask[:n_prompt] == [0] * n_prompt
    actions = tok.decode([t for t, m in zip(seq, mask) if m], skip_special_tokens=False)
    context = tok.decode([t for t, m in zip(seq[n_prompt:], mask[n_prompt:]) if not m], skip_special_tokens=False)
    end = "<|im_end|>" if chat else ""
    assert actions == "".join(t + end for t in turns)  # every model token, and only those
    assert context.count("```output") == 2 and "1024" in context and "1025" in context
    if chat:
        assert context.count("<|im_start|>user") == 2 and context.count("<|im_start|>assistant") == 2
    assert "```output" not in actions


# --------------------------------------------------------------------------------------------------
# stare eval --tools python
# --------------------------------------------------------------------------------------------------

CODE_FOR = {"p1": "print(1+1)", "p2": "print(2+3)", "p3": "print(33)"}
VALUE_FOR = {"p1": "2", "p2": "5", "p3": "33"}


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """The tiny Llama, fitted (~5 s) on: prompt -> one python block; its output -> the boxed answer, EOS. Token
    ids are built piece by piece, as the multi-turn loop feeds them."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder = build_tiny_model(tmp_path_factory.mktemp("tool-model"))
    tok = AutoTokenizer.from_pretrained(folder)
    model = LlamaForCausalLM.from_pretrained(folder)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    seqs, labels = [], []
    for row in PROBLEMS:
        prompt = enc(f"{row['problem']}\n{INSTRUCTION} {TOOL_INSTRUCTION}")
        action = f"```python\n{CODE_FOR[row['id']]}\n```"
        feedback = plain_format().wrap(VALUE_FOR[row["id"]], action_text=action)
        a, f, b = enc(action), enc(feedback), enc(f"\\boxed{{{VALUE_FOR[row['id']]}}}") + [tok.eos_token_id]
        seqs.append(prompt + a + f + b)
        labels.append([-100] * len(prompt) + a + [-100] * len(f) + b)
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    lab = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
    att = (torch.arange(width)[None] < torch.tensor([len(s) for s in seqs])[:, None]).long()
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        opt.zero_grad()
        model(input_ids=ids, attention_mask=att, labels=lab).loss.backward()
        opt.step()
    model.save_pretrained(folder)
    return folder


def stare(*args):
    return subprocess.run([sys.executable, "-m", "stare.cli.main", *args], capture_output=True, text=True)


def test_eval_with_tools_end_to_end(tool_model, tmp_path):
    data = write_problems(tmp_path / "mini.jsonl")
    out = tmp_path / "ev"
    # greedy: one sample per problem (--k 1; greedy with k > 1 is refused)
    res = stare("eval", "--bench", "aime25", "--model", str(tool_model), "--data-file", str(data), "--k", "1",
                "--temperature", "0", "--max-tokens", "60", "--backend", "hf", "--out", str(out), "--tools", "python")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert {"turns", "tool_calls", "tool_errors", "done_reason", "tool_output_tokens"} <= set(r)
        assert r["turns"] == r["tool_calls"] + 1 >= 2 and r["tool_errors"] == 0  # a tool turn, then an answer
        pid = r["problem_id"]
        assert f"```python\n{CODE_FOR[pid]}\n```\n```output\n{VALUE_FOR[pid]}\n```\n" in r["response"]
        assert r["done_reason"] == "answer" and r["extracted"] == VALUE_FOR[pid] and r["correct"]
        assert 0 < r["num_tokens"] and r["tool_output_tokens"] > 0
        assert r["num_tokens"] + r["tool_output_tokens"] <= 60 and r["truncated"] is False
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mean_turns"] == sum(r["turns"] for r in rows) / 3
    assert summary["mean_tool_calls"] == sum(r["tool_calls"] for r in rows) / 3 > 0
    assert summary["truncated"] == 0.0 and summary["not_attempted"] == 0
    assert summary["tools"]["tool"] == "python" and summary["tools"]["format"] == "plain"
    assert summary["avg_at_k"] == 1.0
    assert "| mean tool calls |" in (out / "summary.md").read_text()
    # the isolation the tool calls ran with: per sample and in the summary
    assert [r["sandbox_isolation"] for r in rows] == [USED] * 3 and summary["sandbox_isolation"] == USED
    assert f"| sandbox isolation | {USED} | |" in (out / "summary.md").read_text()


def test_eval_tools_bad_input(tmp_path):
    for args, message in [(["--tools", "bash"], "unknown tool 'bash'; valid tools: python"),
                          (["--tools", "python", "--harness", "lm-eval"], "--tools works with --harness stare only")]:
        res = stare("eval", "--bench", "aime25", "--model", "x/y", "--out", str(tmp_path / "o"), *args)
        lines = [x for x in res.stderr.splitlines() if x.strip()]
        assert res.returncode == 2 and len(lines) == 1 and message in lines[0], res.stderr


class FakeVLLM:
    """vLLM's offline LLM, as the tool backend calls it: one scripted turn per request, recording the params."""

    def __init__(self, tok, script):
        self.tok, self.script, self.params = tok, script, []

    def generate(self, prompts, params, use_tqdm=False):
        self.params.append(params)
        outs = []
        for p in prompts:
            text, eos = self.script.pop(0)
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + ([self.tok.eos_token_id] if eos else [])
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, text=text,
                                                                 finish_reason="stop", stop_reason=None)]))
        return outs


def test_tools_on_the_vllm_backend_interface(tokenizers):
    from stare.cli.agent.multiturn import ToolUseBackend
    from stare.eval.protocols import Protocol

    tok = tokenizers[0]
    llm = FakeVLLM(tok, [("```python\nprint(3 * 11)\n```\n```output", False), ("no clue", True),
                         ("So \\boxed{33}", True)])
    inner = SimpleNamespace(name="vllm", tokenizer=tok, llm=llm, _sampling_params=lambda **kw: kw,
                            prompt_text=lambda problem, instruction: f"{problem}\n{instruction}")
    backend = ToolUseBackend(inner, ToolConfig(max_turns=3, isolation=ISOLATION))
    assert TOOL_INSTRUCTION in backend.prompt_text("Q", INSTRUCTION)
    (a, n_a, xa), (b, n_b, xb) = backend.generate("Q", 2, Protocol("stare", 2, 1.0, 0.7, 200), seed=1)
    assert llm.params[0][0]["stop"] == ["```output"] and llm.params[0][0]["include_stop_str_in_output"]
    assert [len(p) for p in llm.params] == [2, 1]  # round 2: only the episode still running
    assert xa["turns"] == 2 and xa["tool_calls"] == 1 and xa["answer_text"] == "So \\boxed{33}"
    assert a.startswith("```python\nprint(3 * 11)\n```\n```output\n33\n```\n") and a.endswith("So \\boxed{33}")
    assert xb == {"answer_text": None, "turns": 1, "tool_calls": 0, "tool_errors": 0, "done_reason": "no_action",
                  "tool_output_tokens": 0, "truncated": False, "sandbox_isolation": USED}  # no call: the set one
    assert xa["sandbox_isolation"] == USED
    assert n_b == len(tok("no clue", add_special_tokens=False)["input_ids"])  # EOS not counted


class ScriptedToolBackend:
    """Harness backend returning fixed samples: plain (text, tokens) pairs, or tool-use triples with extras."""

    name = "scripted"

    def __init__(self, samples, tools_info=None):
        self.samples = samples
        if tools_info is not None:
            self.tools_info = tools_info

    def prompt_text(self, problem, instruction):
        return problem

    def generate(self, prompt, n, proto, seed):
        return self.samples[prompt]


def test_harness_scores_the_answer_turn_and_averages_turns(tmp_path):
    from stare.eval.data import Problem
    from stare.eval.harness import run_eval
    from stare.eval.protocols import Protocol

    problems = [Problem("a", "qa", "7")]
    proto = Protocol("stare", 2, 1.0, 0.7, 64)
    extra = {"turns": 2, "tool_calls": 1, "tool_errors": 0, "done_reason": "answer", "tool_output_tokens": 5}
    samples = {"qa": [("```output\n\\boxed{7}\n```\nhmm", 9, {**extra, "answer_text": None, "turns": 3,
                                                                  "tool_calls": 2, "done_reason": "no_action"}),
                      ("```output\n8\n```\n\\boxed{7}", 8, {**extra, "answer_text": "\\boxed{7}"})]}
    s = run_eval(problems, ScriptedToolBackend(samples, {"tool": "python"}), proto, tmp_path / "t", bench="aime25",
                 model="m", seed=0, resume=False)
    rows = [json.loads(x) for x in (tmp_path / "t" / "samples.jsonl").read_text().splitlines()]
    assert [r["correct"] for r in rows] == [False, True]  # the box printed by the tool is not an answer
    assert [r["extracted"] for r in rows] == [None, "7"] and "answer_text" not in rows[0]
    assert [r["turns"] for r in rows] == [3, 2] and rows[0]["response"].startswith("```output")
    assert s["mean_turns"] == 2.5 and s["mean_tool_calls"] == 1.5 and s["tools"] == {"tool": "python"}
    plain = {"qa": [("so \\boxed{7}", 4), ("\\boxed{6}", 3)]}  # a backend without tools: as before
    s = run_eval(problems, ScriptedToolBackend(plain), proto, tmp_path / "p", bench="aime25", model="m", seed=0,
                 resume=False)
    rows = [json.loads(x) for x in (tmp_path / "p" / "samples.jsonl").read_text().splitlines()]
    assert [r["correct"] for r in rows] == [True, False] and set(rows[0]) == {
        "problem_id", "sample_idx", "response", "extracted", "correct", "num_tokens"}
    assert "mean_turns" not in s and "tools" not in s and s["avg_at_k"] == 0.5


def test_tools_on_vllm_context_full_ends_one_sample_and_seeds_are_distinct(tokenizers, tmp_path, monkeypatch):
    """Against the strict vLLM stand-in: sample 0's tool output fills the model's context, so it ends as truncated
    (vLLM would refuse the whole next batch for its prompt); sample 1 answers in the same batch. Every turn of
    every sample has its own seed; turn 0 uses the sample's seed."""
    from vllm_standin import make_vllm, scripted

    from stare.cli.agent.multiturn import ToolUseBackend
    from stare.eval.backends import make_backend
    from stare.eval.protocols import Protocol

    tok = tokenizers[0]
    folder = tmp_path / "m"
    build_tiny_model(folder)
    prompt = f"Q\n{INSTRUCTION} {TOOL_INSTRUCTION}"
    n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
    action = "```python\nprint('x ' * 300)\n```\n```output"
    n_action = len(tok(action, add_special_tokens=False)["input_ids"])
    context = n_prompt + n_action + 40  # room for the action, not for its 300-word output
    base = 1000

    asked = []

    def model(child):  # the first turn asked for (sample 0's first) writes code; every other turn answers
        asked.append(child.seed)
        text = action if len(asked) == 1 else "So \\boxed{33}"
        return scripted(tok, lambda p, j: text, eos=True)(child)

    module, calls = make_vllm(model, max_model_len=context)
    monkeypatch.setitem(sys.modules, "vllm", module)
    backend = ToolUseBackend(make_backend("vllm", str(folder)), ToolConfig(max_turns=3, isolation=ISOLATION))
    (a, _, xa), (b, _, xb) = backend.generate(prompt, 2, Protocol("stare", 2, 1.0, 0.7, 4000), seed=base)
    assert backend.context_length == context
    assert xa["done_reason"] == "context" and xa["truncated"] and xa["tool_calls"] == 1
    assert "```output\nx x x" in a  # the output that filled the context is in the transcript
    assert xb["done_reason"] == "answer" and not xb["truncated"] and xb["answer_text"] == "So \\boxed{33}"
    assert len(calls["generate"]) == 1  # sample 0 never went back to the engine with a full context
    seeds = [c["seed"] for c in calls["samples"]]
    assert seeds == [base, base + 1]
    # a prompt that does not fit raises PromptTooLong (the harness records the problem as not attempted)
    from stare.eval.backends import PromptTooLong

    with pytest.raises(PromptTooLong):
        backend.generate("x " * context, 2, Protocol("stare", 2, 1.0, 0.7, 40), seed=base)


def test_tool_output_never_overshoots_the_token_budget(tokenizers):
    """The budget (max tokens) covers tool output as well as model turns: an observation longer than the room
    left is cut to it and the sample ends as truncated (token_budget); found on the real engine (a 128-token
    budget once ended with 116 + 43 tokens)."""
    from stare.cli.agent.multiturn import ToolUseBackend
    from stare.eval.protocols import Protocol

    tok = tokenizers[0]
    action = "```python\nprint('x ' * 300)\n```\n```output"
    llm = FakeVLLM(tok, [(action, False)])
    inner = SimpleNamespace(name="vllm", tokenizer=tok, llm=llm, _sampling_params=lambda **kw: kw,
                            prompt_text=lambda problem, instruction: f"{problem}\n{instruction}")
    budget = len(tok(action, add_special_tokens=False)["input_ids"]) + 25  # room for 25 tokens of output
    backend = ToolUseBackend(inner, ToolConfig(max_turns=3, isolation=ISOLATION))
    ((text, n_model, extra),) = backend.generate("Q", 1, Protocol("stare", 1, 1.0, 0.7, budget), seed=1)
    assert extra["tool_calls"] == 1 and extra["done_reason"] == "token_budget" and extra["truncated"]
    assert n_model + extra["tool_output_tokens"] == budget  # filled exactly, not past it
    assert text.startswith(action) and "x x x" in text
    assert len(llm.params) == 1  # the sample never went back to the engine


NO_NS_TOOL_USE = """
import json, subprocess, sys
eval_args, train_args = json.loads(sys.argv[1])
out = {}
try:
    from stare.cli.agent.python_agent import AgentExecutor
    AgentExecutor()  # what a rollout actor does when it loads --train.agent_func_path
    out["agent"] = "no error"
except Exception as exc:
    out["agent"] = f"{type(exc).__name__}: {exc}"
for name, args in (("eval", eval_args), ("train", train_args)):
    res = subprocess.run([sys.executable, "-m", "stare.cli.main", *args], capture_output=True, text=True)
    out[name] = [res.returncode, res.stderr]
print(json.dumps(out))
"""


def test_tool_use_where_namespaces_are_unavailable_fails_in_one_line(tmp_path, monkeypatch):
    """Without user namespaces (simulated as the sandbox detects it), the tool-use paths, which default to isolation
    namespaces, stop before any work with the sandbox's one line: the training agent when a rollout actor loads it,
    `stare eval --tools python` and `stare train --preset qwen-7b-tool-use` (exit 2, nothing written)."""
    from no_userns import run_json_without_userns

    monkeypatch.delenv("STARE_SANDBOX_ISOLATION")  # the default
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "sft").mkdir()
    data = write_problems(tmp_path / "mini.jsonl")
    eval_args = ["eval", "--bench", "aime25", "--model", str(tmp_path / "model"), "--data-file", str(data),
                 "--backend", "hf", "--tools", "python", "--out", str(tmp_path / "ev")]
    train_args = ["train", "--preset", "qwen-7b-tool-use", "--set", f"cold_start_checkpoint={tmp_path / 'sft'}",
                  "--out", str(tmp_path / "run")]
    out = run_json_without_userns(NO_NS_TOOL_USE, json.dumps([eval_args, train_args]), namespaces_here=NS)
    expected = "sandbox isolation 'namespaces' is unavailable here: "
    assert out["agent"].startswith(f"SandboxError: {expected}") and "STARE_SANDBOX_ISOLATION=auto" in out["agent"]
    for name in ("eval", "train"):
        code, stderr = out[name]
        lines = [x for x in stderr.splitlines() if x.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {expected}"), (name, stderr[-2000:])
    assert out["train"][1].rstrip().endswith("(for this run: --set sandbox_isolation=auto)")  # the preset's setting
    assert not (tmp_path / "ev").exists() and not (tmp_path / "run").exists()


def test_the_gpu_preset_setting_decides_the_training_sandboxs_isolation(monkeypatch):
    """`sandbox_isolation` (a GPU preset setting, namespaces by default) reaches the rollout workers as
    STARE_SANDBOX_ISOLATION, and `stare train` checks that isolation on this node before Ray starts, whatever the
    driver's shell says (Ray's runtime_env overrides it in the workers)."""
    from stare.cli.openrlhf_backend import train as openrlhf_train
    from stare.cli.openrlhf_backend import launch as orl
    from stare.cli.presets import resolve

    sets = ["cold_start_checkpoint=owner/qwen2.5-7b-sft"]
    checked = []
    monkeypatch.setattr("stare.cli.agent.loop.check_tool_isolation", lambda config: checked.append(config.isolation))
    monkeypatch.setenv("STARE_SANDBOX_ISOLATION", "namespaces")  # the shell's value, which the setting overrides
    for value in ("namespaces", "auto", "basic"):
        resolved = resolve("qwen-7b-tool-use", "grpo", sets + [f"sandbox_isolation={value}"])
        env = orl.plan(resolved, "runs/x")["ray"]["runtime_env"]["env_vars"]
        assert env["STARE_SANDBOX_ISOLATION"] == value
        openrlhf_train._check_tool_sandbox(env)
    assert checked == ["namespaces", "auto", "basic"]
    default = orl.plan(resolve("qwen-7b-tool-use", "grpo", sets), "runs/x")["ray"]["runtime_env"]["env_vars"]
    assert default["STARE_SANDBOX_ISOLATION"] == "namespaces"
    single_turn = orl.plan(resolve("qwen-7b-short-cot", "grpo"), "runs/x")["ray"]["runtime_env"]["env_vars"]
    assert "STARE_SANDBOX_ISOLATION" not in single_turn
