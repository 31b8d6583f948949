"""`stare eval --batching` (stare.eval.batching): every problem in flight at once against one at a time, on the harness,
the strict vLLM stand-in, the HF backend and the tool loop; the record and `--resume`; `--engines auto` and the
evaluation layout `stare run` plans on a GPU preset.

The real vLLM engine's side (a kill and `--resume` in both modes, two engines, the chunked-prefill crash avoided) is
in tests/test_vllm_cpu.py; the HF backend's draws against transformers' own `generate` in tests/test_eval_vllm.py.
"""
from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from tiny_models import INSTRUCTION, build_tiny_model, write_problems
from vllm_standin import make_vllm, scripted

from stare.cli.main import app
from stare.eval import batching, harness, record
from stare.eval.data import Problem
from stare.eval.protocols import Protocol, problem_seed

K = 3
PROTO = Protocol("stare", K, 1.0, 0.7, 40)
QUESTIONS = ["What is 1+1?", "What is 2+3? Think about it.", "Find 033.", "What is 7 times 6, the product?",
             "Name 12.", "What is 9-4?"]
PROBLEMS = [Problem(f"q{i}", q, str(i)) for i, q in enumerate(QUESTIONS)]


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_line(res) -> str:
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.output
    return lines[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tok(model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


# ---- the harness, on a scripted backend ---------------------------------------------------------------------------

class Reversed:
    """A backend whose ``generate_many`` hands the problems back last first (and ``generate`` one by one); each
    sample says its seed, so the file shows which seed every sample drew from."""

    name = "scripted"

    def __init__(self):
        self.many_calls, self.one_calls = [], 0

    def prompt_text(self, problem, instruction):
        return problem

    def generate(self, prompt, n, proto, seed):
        self.one_calls += 1
        return [(f"\\boxed{{{seed + j}}}", 3, {"truncated": False}) for j in range(n)]

    def generate_many(self, requests, proto):
        requests = list(requests)
        self.many_calls.append([key for key, *_ in requests])
        for key, prompt, n, seed in reversed(requests):
            yield key, self.generate(prompt, n, proto, seed)


@pytest.mark.parametrize("batching_mode", ["all", "problem"])
def test_both_modes_write_the_same_file_in_the_bench_order_from_the_same_seeds(tmp_path, batching_mode):
    backend = Reversed()
    summary = harness.run_eval(PROBLEMS, backend, PROTO, tmp_path, bench="aime24", model="m", seed=7, resume=False,
                               batching=batching_mode)
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["problem_id"], r["sample_idx"]) for r in rows] == [(p.id, j) for p in PROBLEMS for j in range(K)]
    # sample j of the problem at position i drew from (7 mod 2**31) * 2**32 + i * K + j, in both modes
    assert [r["extracted"] for r in rows] == [str((7 << 32) + i * K + j) for i in range(len(PROBLEMS))
                                              for j in range(K)]
    if batching_mode == "all":  # every problem handed over at once, in the bench's order
        assert backend.many_calls == [list(range(len(PROBLEMS)))] and backend.one_calls == len(PROBLEMS)
    else:
        assert backend.many_calls == [] and backend.one_calls == len(PROBLEMS)
    rec = json.loads((tmp_path / record.RECORD).read_text())
    assert rec["batching"] == batching_mode and rec["batching_contract"] == batching.BATCHING[batching_mode]
    assert summary["batching"] == batching_mode
    assert f"batching {batching_mode}" in (tmp_path / "summary.md").read_text()


def test_resume_with_all_in_flight_draws_the_rest_from_their_own_seeds(tmp_path):
    """A folder holding two finished problems and half a third: --resume hands only the others to the engine, at
    once, each at its own position's seeds; the kept lines stay as they were."""
    full = tmp_path / "full"
    harness.run_eval(PROBLEMS, Reversed(), PROTO, full, bench="aime24", model="m", seed=7, resume=False)
    lines = (full / "samples.jsonl").read_text().splitlines()
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / record.RECORD).write_text((full / record.RECORD).read_text())
    (cut / "samples.jsonl").write_text("\n".join(lines[3 * K:5 * K] + lines[:1]) + "\n")  # q3, q4 and part of q0
    backend = Reversed()
    harness.run_eval(PROBLEMS, backend, PROTO, cut, bench="aime24", model="m", seed=7, resume=True)
    assert backend.many_calls == [[0, 1, 2, 5]]
    assert (cut / "samples.jsonl").read_text() == (full / "samples.jsonl").read_text()


def test_a_scoring_error_stops_the_run_keeps_what_was_written_and_closes_the_stream(tmp_path, monkeypatch):
    """The scoring thread's error reaches the caller; the problems written before it stay; the backend's stream is
    closed (a vLLM stream aborts its requests then)."""
    from stare.eval.scoring import ScoringError

    closed = []

    class Streaming(Reversed):
        def generate_many(self, requests, proto):
            try:
                yield from super().generate_many(requests, proto)
            finally:
                closed.append(True)

    real = harness.score_many
    seen = []

    def failing(pairs, timeout=5.0):
        seen.append(len(pairs))
        if len(seen) == 3:
            raise ScoringError("the checker died")
        return real(pairs, timeout=timeout)

    monkeypatch.setattr(harness, "score_many", failing)
    with pytest.raises(ScoringError, match="the checker died"):
        harness.run_eval(PROBLEMS, Streaming(), PROTO, tmp_path, bench="aime24", model="m", seed=7, resume=False)
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * K and closed == [True]
    assert {r["problem_id"] for r in rows} == {"q5", "q4"}  # the first two handed back (last first)


# ---- the vLLM backend against the strict stand-in -------------------------------------------------------------------

def by_length(tok, lengths):
    """A model for the stand-in: problem i's samples are ``lengths[i]`` tokens of "7" and then EOS, so the engine
    finishes the problems in order of those lengths."""
    def texts(prompt, j):
        i = next(n for n, q in enumerate(QUESTIONS) if prompt.startswith(q))
        return "7" * lengths[i]

    return scripted(tok, texts, eos=True)


def test_vllm_all_in_flight_yields_each_problem_as_it_finishes(model, tok, monkeypatch):
    from stare.eval.backends import make_backend

    lengths = [5, 1, 9, 3, 7, 2]
    module, calls = make_vllm(by_length(tok, lengths))
    monkeypatch.setitem(sys.modules, "vllm", module)
    backend = make_backend("vllm", str(model), seed=7)
    requests = [(i, backend.prompt_text(p.problem, INSTRUCTION), K, problem_seed(7, i, K)) for i, p in
                enumerate(PROBLEMS)]
    got = list(backend.generate_many(requests, PROTO))
    n_tokens = [len(tok("7" * n, add_special_tokens=False)["input_ids"]) for n in lengths]
    # handed back in the order the engine finished them (fewest tokens first), each with its own samples
    assert [i for i, _ in got] == sorted(range(len(PROBLEMS)), key=lambda i: (n_tokens[i], i))
    assert all(samples == [("7" * lengths[i], n_tokens[i], {"truncated": False})] * K for i, samples in got)
    # all six requests went in before the first step, with n = k and each problem's seed; none aborted
    assert [params.n for _, _, params in calls["add_request"]] == [K] * len(PROBLEMS)
    assert [params.seed for _, _, params in calls["add_request"]] == [problem_seed(7, i, K) for i in
                                                                       range(len(PROBLEMS))]
    assert calls["generate"] == [] and calls["aborted"] == [] and len(calls["steps"]) == len(PROBLEMS)


def test_vllm_stream_closed_early_aborts_the_requests_in_flight(model, tok, monkeypatch):
    from stare.eval.backends import make_backend

    module, calls = make_vllm(by_length(tok, [1, 2, 3, 4, 5, 6]), finish_order="added")
    monkeypatch.setitem(sys.modules, "vllm", module)
    backend = make_backend("vllm", str(model), seed=7)
    stream = backend.generate_many([(i, backend.prompt_text(p.problem, INSTRUCTION), K, i) for i, p in
                                    enumerate(PROBLEMS)], PROTO)
    assert next(stream)[0] == 0 and next(stream)[0] == 1
    stream.close()  # a kill, a stop or an error in the caller
    ids = [rid for rid, _, _ in calls["add_request"]]
    assert calls["aborted"] == [sorted(ids[2:])]
    assert not backend.llm.llm_engine.has_unfinished_requests()
    # the engine serves the next evaluation with fresh request ids
    again = list(backend.generate_many([(0, backend.prompt_text(PROBLEMS[0].problem, INSTRUCTION), K, 0)], PROTO))
    assert [key for key, _ in again] == [0] and len(set(rid for rid, _, _ in calls["add_request"])) == 7


def test_vllm_prompt_too_long_is_yielded_and_never_reaches_the_engine(model, tok, monkeypatch):
    from stare.eval.backends import PromptTooLong, make_backend

    module, calls = make_vllm(by_length(tok, [1] * 6), max_model_len=60)
    monkeypatch.setitem(sys.modules, "vllm", module)
    backend = make_backend("vllm", str(model), seed=7)
    long_prompt = "What is 1+1? " * 40
    got = dict(backend.generate_many([(0, backend.prompt_text(PROBLEMS[0].problem, INSTRUCTION), K, 0),
                                      (1, long_prompt, K, 3)], PROTO))
    assert isinstance(got[1], PromptTooLong) and got[1].context_length == 60
    assert len(calls["add_request"]) == 1 and len(got[0]) == K


def test_cli_all_and_problem_give_the_same_files_and_resume_refuses_to_mix(model, tok, tmp_path, monkeypatch):
    module, calls = make_vllm(by_length(tok, [4, 1, 6, 2, 5, 3]))
    monkeypatch.setitem(sys.modules, "vllm", module)
    data = write_problems(tmp_path / "six.jsonl", [{"id": p.id, "problem": p.problem, "answer": "7"}
                                                    for p in PROBLEMS])
    common = ["eval", "--bench", "aime25", "--model", model, "--backend", "vllm", "--data-file", data, "--k", K,
              "--max-tokens", 40, "--seed", 7]
    for mode in ("all", "problem"):
        res = invoke(*common, "--out", tmp_path / mode, "--batching", mode)
        assert res.exit_code == 0, res.output
    assert (tmp_path / "all" / "samples.jsonl").read_text() == (tmp_path / "problem" / "samples.jsonl").read_text()
    # one engine call per problem with problem; every problem through add_request with all
    assert len(calls["generate"]) == len(PROBLEMS) and len(calls["add_request"]) == len(PROBLEMS)
    line = one_line(invoke(*common, "--out", tmp_path / "problem", "--resume", "--batching", "all"))
    assert "--batching all" in line and "with batching problem" in line
    res = invoke(*common, "--out", tmp_path / "problem", "--resume")  # without --batching: the folder's mode
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "problem" / "summary.json").read_text())["batching"] == "problem"


def test_invariant_needs_cuda_and_sets_vllm_s_switch_before_the_engine_starts(model, tok, tmp_path, monkeypatch):
    import torch

    module, calls = make_vllm(by_length(tok, [1] * 6))
    seen = []
    real_llm = module.LLM

    class Recording(real_llm):
        def __init__(self, *args, **kwargs):
            import os

            seen.append(os.environ.get("VLLM_BATCH_INVARIANT"))
            super().__init__(*args, **kwargs)

    module.LLM = Recording
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    data = write_problems(tmp_path / "one.jsonl", [{"id": "q0", "problem": QUESTIONS[0], "answer": "7"}])
    args = ["eval", "--bench", "aime25", "--model", model, "--backend", "vllm", "--data-file", data, "--k", K,
            "--batching", "invariant"]
    if not torch.cuda.is_available():
        line = one_line(invoke(*args, "--out", tmp_path / "o"))
        assert "--batching invariant needs vLLM on a CUDA GPU" in line and seen == []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    res = invoke(*args, "--out", tmp_path / "o2")
    assert res.exit_code == 0, res.output
    assert seen == ["1"]
    assert "enable_chunked_prefill" not in calls["llm"][-1]  # a GPU keeps vLLM's default
    assert json.loads((tmp_path / "o2" / record.RECORD).read_text())["batching"] == "invariant"


def test_the_cpu_engine_is_asked_for_no_chunked_prefill(model, tok, monkeypatch):
    import torch

    from stare.eval.backends import make_backend

    module, calls = make_vllm(by_length(tok, [1] * 6))
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    make_backend("vllm", str(model))
    assert calls["llm"][-1]["enable_chunked_prefill"] is False


# ---- the HF backend ---------------------------------------------------------------------------------------------

def test_hf_batches_prompts_of_about_the_same_length_within_the_token_slots(model, monkeypatch):
    """Which problems share a ``generate`` call: sorted by prompt length, a batch grows while its padded prompt
    tokens stay within PAD_SHARE of the real ones and its rows x (longest prompt + response) within the slots;
    checked against a brute-force walk of the same rule, and every problem's samples equal to it alone."""
    from stare.eval import backends

    b = backends.HFBackend(str(model), max_batch_tokens=400)
    seen = []
    real = backends.HFBackend._batch

    def spy(self, problems, proto):
        seen.append([key for key, *_ in problems])
        return real(self, problems, proto)

    monkeypatch.setattr(backends.HFBackend, "_batch", spy)
    prompts = ["a", "b" * 3, "c c c c c c c c c c c c", "d" * 2, "e e e e e e e e e e e e e", "f f f f f f f f"]
    requests = [(i, p, 2, problem_seed(1, i, 2)) for i, p in enumerate(prompts)]
    proto = Protocol("stare", 2, 1.0, 0.7, 6)
    many = dict(b.generate_many(requests, proto))
    lengths = {i: len(b.tokenizer(p, add_special_tokens=False)["input_ids"]) for i, p in enumerate(prompts)}
    want, batch = [], []
    for i in sorted(lengths, key=lambda i: (lengths[i], i)):
        grown = batch + [i]
        rows, longest = 2 * len(grown), max(lengths[j] for j in grown)
        if batch and (rows * (longest + 6) > 400 or rows * longest > backends.PAD_SHARE * sum(2 * lengths[j]
                                                                                              for j in grown)):
            want.append(batch)
            grown = [i]
        batch = grown
    want.append(batch)
    assert seen == want and any(len(x) > 1 for x in want) and len(want) > 1
    one = {i: b.generate(p, 2, proto, seed) for i, p, _, seed in requests}
    assert many == one


# ---- the tool loop ------------------------------------------------------------------------------------------------

def test_tool_turns_of_every_problem_go_to_vllm_together_with_the_seeds_of_each_alone(model, tok, monkeypatch):
    """generate_many over three problems: each round is one engine call holding every unfinished sample of every
    problem; each sample's turns draw from the seeds they draw from when its problem runs alone."""
    from stare.cli.agent.loop import ToolConfig
    from stare.cli.agent.multiturn import ToolUseBackend
    from stare.eval.backends import make_backend

    def model_fn(child):  # a first turn (a short prompt) writes code; a later one (the tool output is in its
        text = tok.decode(child.prompt_ids)  # context) answers
        reply = "So \\boxed{2}" if "```output" in text else "```python\nprint(1+1)\n```\n```output"
        return scripted(tok, lambda p, j: reply, eos=True)(child)

    module, calls = make_vllm(model_fn)
    monkeypatch.setitem(sys.modules, "vllm", module)
    config = ToolConfig(max_turns=3, isolation="auto")
    backend = ToolUseBackend(make_backend("vllm", str(model)), config)
    proto = Protocol("stare", 2, 1.0, 0.7, 400)
    prompts = [backend.prompt_text(q, INSTRUCTION) for q in QUESTIONS[:3]]
    many = dict(backend.generate_many([(i, p, 2, problem_seed(5, i, 2)) for i, p in enumerate(prompts)], proto))
    batched_calls = list(calls["generate"])
    seeds_many = [c["seed"] for c in calls["samples"]]
    calls["samples"].clear()
    one = {i: backend.generate(p, 2, proto, problem_seed(5, i, 2)) for i, p in enumerate(prompts)}
    assert many == one
    assert len(batched_calls) == 2 and [len(prompts) for prompts, _ in batched_calls] == [6, 6]  # two rounds
    assert sorted(seeds_many) == sorted(c["seed"] for c in calls["samples"])
    assert all(x["tool_calls"] == 1 and x["done_reason"] == "answer" for s in many.values() for _, _, x in s)


# ---- --engines auto, and the layout stare run plans -------------------------------------------------------------------

def test_needed_tp_against_a_brute_force_search():
    from stare.cli.eval_plan import WEIGHT_SHARE, needed_tp

    gib = 1 << 30
    for weights in (None, 1, 15 * gib, 59 * gib, 61 * gib, 65 * gib, 130 * gib, 500 * gib, 4000 * gib):
        for gpu in (None, 24 * gib, 80 * gib, 141 * gib):
            for tp in (1, 2, 4):
                for gpus in (1, 2, 8):
                    got = needed_tp(weights, gpu, tp, gpus)
                    if not weights or not gpu:
                        assert got == tp
                        continue
                    ok = [t for t in (tp * 2 ** e for e in range(12)) if t <= max(gpus, tp)
                          and weights / t <= WEIGHT_SHARE * gpu]
                    largest = max(t for t in (tp * 2 ** e for e in range(12)) if t <= max(gpus, tp))
                    assert got == (ok[0] if ok else largest), (weights, gpu, tp, gpus, got)


def test_engines_auto_without_a_gpu_is_one_engine_here_without_ray(model, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    data = write_problems(tmp_path / "one.jsonl", [{"id": "q0", "problem": QUESTIONS[0], "answer": "2"}])
    res = invoke("eval", "--bench", "aime25", "--model", model, "--backend", "hf", "--data-file", data, "--k", 2,
                 "--max-tokens", 4, "--engines", "auto", "--out", tmp_path / "o")
    assert res.exit_code == 0, res.output
    assert "--engines auto: no GPU here, so one engine in this process" in res.output
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["engines"] == 1


@pytest.mark.parametrize("weights_gib, gpus, want", [(15, 8, (8, 1)), (61, 8, (4, 2)), (61, 1, (1, 1)),
                                                     (130, 8, (2, 4))])
def test_engines_auto_on_gpus_sizes_tp_from_the_weight_files(tmp_path, monkeypatch, weights_gib, gpus, want):
    """auto_layout with a fake set of 80 GiB GPUs and a sparse weight file: tp the smallest power of two at which a
    share of the weights fits three quarters of a GPU (at most the GPUs there), engines the GPUs over tp."""
    import torch

    from stare.cli.eval_plan import auto_layout

    folder = tmp_path / "m"
    folder.mkdir()
    with open(folder / "model.safetensors", "wb") as f:
        f.truncate(weights_gib << 30)  # sparse: the size without the disk
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 << 30))
    printed = []
    console = SimpleNamespace(print=lambda text, **kw: printed.append(text))
    plan = SimpleNamespace(ray_address=None, tp=1, backend="vllm", model=str(folder))
    assert auto_layout(plan, console) == want
    assert f"{want[0]} engine(s) x {want[1]} GPU(s) on the {gpus} GPU(s) of this machine" in printed[0]
    plan.backend = "hf"  # one GPU an engine, whatever the model
    assert auto_layout(plan, console) == (gpus, 1)


def plan_json(*args):
    res = invoke("run", *args, "--dry-run")
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.mark.parametrize("preset, extra, engines, tp", [
    ("qwen-7b-short-cot", [], 8, 1),  # one 8-GPU node, one engine a GPU
    ("qwen-14b-short-cot", [], 8, 1),  # 27.5 GiB of weights and a 32k context fit one 80 GiB card (rollouts: tp 2)
    # the 32B model (61 GiB) needs tp 2 on 80 GiB cards for one sequence of its 131072-token context (32 GiB of KV at
    # tp 1): four engines a node (its rollouts run at tp 4)
    ("qwen-32b-short-cot", [], 4, 2),
    ("qwen-32b-short-cot", ["--ray-address", "10.0.0.1:6379"], 16, 2),  # its four nodes
    ("qwen-32b-short-cot", ["--set", "gpu_memory_gib=141"], 8, 1),  # H200s hold it whole
    ("qwen-7b-short-cot", ["--engines", "3", "--tp", "2"], 3, 2),  # given: kept
    ("qwen-7b-short-cot", ["--backend", "hf"], 8, 1),
])
def test_stare_run_evaluates_on_every_gpu_of_the_preset(tmp_path, preset, extra, engines, tp):
    from stare.cli.presets import load_preset

    plan = plan_json("--preset", preset, "--out", tmp_path / "r", *extra)
    assert plan["eval_layout"]["engines"] == engines and plan["eval_layout"]["tp"] == tp
    for step in plan["steps"]:
        if step["step"] == "eval":
            cmd = step["command"]
            assert cmd[cmd.index("--engines") + 1] == str(engines) and cmd[cmd.index("--tp") + 1] == str(tp)
    s = load_preset(preset).settings  # on its base: the file itself may not state the layout
    gpus = s["gpus_per_node"] * (s["nodes"] if "--ray-address" in extra else 1)
    if not extra or extra[0] in ("--ray-address", "--set"):  # the default: every GPU of the node(s)
        assert engines * tp == gpus and tp <= s["vllm_tensor_parallel"]


def test_stare_run_dry_run_needs_no_ray(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    plan = plan_json("--preset", "qwen-7b-short-cot", "--out", tmp_path / "r")
    assert plan["eval_layout"]["engines"] == 8
