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
from stare.eval import backends, protocols

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

    def spy(self, *args, **kwargs):  # one call holds the rows of several problems, left-padded
        out = original(self, *args, **kwargs)
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        for row, keep, new in zip(ids.tolist(), mask.tolist(), out[:, ids.shape[1]:].tolist()):
            generated.setdefault(tuple(t for t, m in zip(row, keep) if m), []).append(new)
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

    import torch

    cpu = {} if torch.cuda.is_available() else {"enable_chunked_prefill": False}  # the CPU engine's (backends.py)
    assert calls["llm"] == [{"model": str(plain), "tensor_parallel_size": 2, "seed": 7, **cpu}]
    # --batching all: every problem in flight at once through the engine's request API, one request per problem ...
    assert calls["generate"] == [] and len(calls["add_request"]) == len(PROBLEMS)
    for _, _, params in calls["add_request"]:  # ... with n = k samples
        assert (params.n, params.temperature, params.top_p, params.max_tokens) == (K, 1.0, 0.7, 6)
    assert len(calls["steps"]) == len(PROBLEMS) and calls["aborted"] == []
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
    backend = backends.make_backend("vllm", str(chat), tp=1, seed=0)
    prompt = backend.prompt_text(problem["problem"], INSTRUCTION)
    assert prompt == expected
    proto = protocols.Protocol("stare", K, 1.0, 0.7, 6)
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


# --------------------------------------------------------------------------------------------------
# the stand-in itself: what vLLM 0.29.0 enforces (tests/vllm_standin.py cites the source of each rule)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """The untrained tiny Llama (built in a second): for runs whose tokens the stand-in scripts."""
    return build_tiny_model(tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="module")
def small_tok(small_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(small_model)


def test_standin_sampling_params_checks():
    with pytest.raises(TypeError, match="Unexpected keyword argument 'best_of'"):
        SamplingParams(n=2, best_of=2)  # a msgspec Struct: only its fields
    with pytest.raises(VLLMValidationError, match="n must be 1 when using greedy sampling, got 4"):
        SamplingParams(n=4, temperature=0.0)
    # a temperature in (0, 1e-2) is first raised to 1e-2, so only 0 is greedy
    assert SamplingParams(n=2, temperature=5e-6).temperature == 0.01
    for t in (2.5, -0.1, float("nan")):
        with pytest.raises(VLLMValidationError, match="temperature"):
            SamplingParams(temperature=t)
    assert not issubclass(VLLMValidationError, ValueError)  # `except ValueError` does not catch it
    p = SamplingParams(n=1, temperature=0.0, top_p=0.5, seed=-1, stop="x")
    assert (p.top_p, p.seed, p.stop) == (1.0, None, ["x"])  # greedy resets top_p; seed -1 means none


def test_standin_engine_rules(small_model, small_tok, monkeypatch):
    tok = small_tok
    eos = tok.eos_token_id
    words = tok("0123456789", add_special_tokens=False)["input_ids"]

    def model(child):  # the digits, then EOS, then more digits
        yield from words
        yield eos
        while True:
            yield words[0]

    module, calls = make_vllm(model, max_model_len=20)
    llm = module.LLM(small_model, seed=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        module.LLM(small_model, bogus=1)
    prompt = {"prompt_token_ids": [5] * 6}
    (r,) = llm.generate([prompt], SamplingParams(n=3, seed=100, max_tokens=50))
    assert [c["seed"] for c in calls["samples"]] == [100, 101, 102]  # seed + index per sample
    assert [o.index for o in r.outputs] == [0, 1, 2]
    o = r.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason is None  # EOS: stop, no stop_reason
    assert o.token_ids == words + [eos] and o.text == "0123456789"  # the EOS id is kept, not its text
    (r,) = llm.generate([prompt], SamplingParams(n=1, seed=9, max_tokens=50, stop_token_ids=[words[2]]))
    assert calls["samples"][-1]["seed"] == 9  # n = 1: the request's seed
    o = r.outputs[0]
    assert (o.finish_reason, o.stop_reason, o.token_ids) == ("stop", words[2], words[:3])
    (r,) = llm.generate([prompt], SamplingParams(max_tokens=50, stop=["45"]))
    o = r.outputs[0]
    assert (o.finish_reason, o.stop_reason) == ("stop", "45") and o.text == "0123"
    (r,) = llm.generate([prompt], SamplingParams(max_tokens=50, stop=["45"], include_stop_str_in_output=True))
    assert r.outputs[0].text == "012345"
    (r,) = llm.generate([prompt], SamplingParams(max_tokens=3))
    assert (r.outputs[0].finish_reason, len(r.outputs[0].token_ids)) == ("length", 3)  # max_tokens
    (r,) = llm.generate([{"prompt_token_ids": [5] * 15}], SamplingParams(max_tokens=50))
    assert (r.outputs[0].finish_reason, len(r.outputs[0].token_ids)) == ("length", 5)  # 15 + 5 = max_model_len
    # special tokens: skipped in the text unless skip_special_tokens=False
    (r,) = llm.generate([prompt], SamplingParams(max_tokens=50, include_stop_str_in_output=True))
    assert r.outputs[0].text == "0123456789"
    (r,) = llm.generate([prompt], SamplingParams(max_tokens=50, include_stop_str_in_output=True,
                                                 skip_special_tokens=False))
    assert r.outputs[0].text == "0123456789</s>"
    # a prompt of >= max_model_len tokens fails the whole call, before any sample
    before = len(calls["samples"])
    for n in (20, 25):
        with pytest.raises(VLLMValidationError, match="maximum model length of 20"):
            llm.generate([prompt, {"prompt_token_ids": [5] * n}], SamplingParams(max_tokens=5))
    assert len(calls["samples"]) == before
    with pytest.raises(VLLMValidationError, match="must be the same"):
        llm.generate([prompt, prompt], [SamplingParams()])


# --------------------------------------------------------------------------------------------------
# point 1: greedy k > 1 and out-of-range temperatures are refused before any model loads
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["hf", "vllm"])
@pytest.mark.parametrize("flags, words", [
    (["--temperature", "0", "--k", "4"], ["--temperature 0.0", "--k is 4", "use --k 1"]),
    (["--temperature", "0", "--protocol", "r1"], ["--temperature 0.0", "--k is 64", "use --k 1"]),
    (["--temperature", "2.5", "--k", "1"], ["--temperature must be in [0, 2], got 2.5"]),
    (["--temperature", "-1"], ["--temperature must be in [0, 2], got -1.0"]),
])
def test_greedy_with_k_and_bad_temperature_refused(small_model, tmp_path, monkeypatch, backend, flags, words):
    module, calls = make_vllm(lambda child: iter(()))
    monkeypatch.setitem(sys.modules, "vllm", module)
    data = write_problems(tmp_path / "mini.jsonl")
    res = CliRunner().invoke(app, ["eval", "--bench", "aime25", "--model", str(small_model), "--data-file",
                                   str(data), "--backend", backend, "--out", str(tmp_path / "o"), *flags])
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and all(w in lines[0] for w in words), res.output
    assert calls["llm"] == [] and not (tmp_path / "o").exists()  # nothing loaded, nothing written


def test_greedy_with_k_refused_on_the_lm_eval_harness(tmp_path):
    pytest.importorskip("lm_eval")
    data = write_problems(tmp_path / "mini.jsonl")
    res = subprocess.run([sys.executable, "-m", "stare.cli.main", "eval", "--bench", "aime24", "--model", "x/y",
                          "--data-file", str(data), "--harness", "lm-eval", "--backend", "hf", "--temperature", "0",
                          "--k", "2", "--out", str(tmp_path / "o")], capture_output=True, text=True)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "use --k 1" in lines[0], res.stderr
    assert "Traceback" not in res.stderr


def test_greedy_k1_runs_on_the_standin(small_model, small_tok, tmp_path, monkeypatch):
    module, calls = make_vllm(scripted(small_tok, lambda prompt, j: "\\boxed{2}"))
    monkeypatch.setitem(sys.modules, "vllm", module)
    data = write_problems(tmp_path / "mini.jsonl")
    run_cli("eval", "--bench", "aime25", "--model", str(small_model), "--data-file", str(data), "--backend", "vllm",
            "--temperature", "0", "--k", "1", "--out", str(tmp_path / "o"))
    assert calls["requests"] and all(p.n == 1 and p.top_p == 1.0 for _, p in calls["requests"])
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["avg_at_k"] == pytest.approx(1 / 3)


# --------------------------------------------------------------------------------------------------
# point 2: no two samples of a run share a seed; a re-run and --resume redo the same samples
# --------------------------------------------------------------------------------------------------


def seed_revealing_model(tok):
    """Answers with the sample's seed, so samples.jsonl shows which seed each sample drew from."""
    def model(child):
        yield from tok(f"\\boxed{{{child.seed}}}", add_special_tokens=False)["input_ids"]
        yield tok.eos_token_id

    return model


@pytest.mark.parametrize("seed, k", [(0, 1), (7, 3), (-5, 4), (2**31 - 1, 2), (2**40 + 3, 5)])
def test_no_two_samples_share_a_seed(small_model, small_tok, tmp_path, monkeypatch, seed, k):
    module, calls = make_vllm(seed_revealing_model(small_tok))
    monkeypatch.setitem(sys.modules, "vllm", module)
    rows = [{"id": f"q{i}", "problem": f"What is {i}+1?", "answer": str(i + 1)} for i in range(6)]
    data = write_problems(tmp_path / "six.jsonl", rows)
    args = ["eval", "--bench", "aime25", "--model", str(small_model), "--data-file", str(data), "--backend", "vllm",
            "--k", str(k), "--max-tokens", "40", "--seed", str(seed)]
    run_cli(*args, "--out", str(tmp_path / "a"))
    seeds = [c["seed"] for c in calls["samples"]]
    assert len(seeds) == 6 * k and len(set(seeds)) == 6 * k  # every sample its own seed
    assert all(0 <= s < 2**63 for s in seeds)  # a torch generator's range, with room for the tool turns
    # the old per-problem seeds (seed * 1_000_003 + i, each expanded to + j by vLLM) collide whenever k > 1
    old = [seed * 1_000_003 + i + j for i in range(6) for j in range(k)]
    assert (len(set(old)) < len(old)) == (k > 1)
    first = (tmp_path / "a" / "samples.jsonl").read_text()
    assert [json.loads(x)["extracted"] for x in first.splitlines()] == [str(s) for s in seeds]
    # a re-run gives the same samples; so does --resume after a kill mid-problem
    run_cli(*args, "--out", str(tmp_path / "b"))
    assert (tmp_path / "b" / "samples.jsonl").read_text() == first
    lines = first.splitlines()
    (tmp_path / "b" / "samples.jsonl").write_text("\n".join(lines[: 2 * k + 1]) + "\n")
    run_cli(*args, "--out", str(tmp_path / "b"), "--resume")
    assert (tmp_path / "b" / "samples.jsonl").read_text() == first


@pytest.mark.parametrize("batching", ["all", "problem"])
def test_hf_backend_draws_each_problem_as_generate_after_its_first_sample_seed(small_model, tmp_path, batching):
    """Each problem's k samples are what transformers' own sampling draws after ``torch.manual_seed`` of the
    problem's first sample seed, computed here with ``generate(do_sample=True, num_return_sequences=k, top_k=0)``
    one problem at a time, whether the backend batched the problems together (all) or not (problem)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = write_problems(tmp_path / "mini.jsonl")
    run_cli("eval", "--bench", "aime25", "--model", str(small_model), "--data-file", str(data), "--backend", "hf",
            "--k", "2", "--max-tokens", "5", "--seed", "4", "--top-p", "0.9", "--temperature", "1.3",
            "--batching", batching, "--out", str(tmp_path / "o"))
    rows = [json.loads(x) for x in (tmp_path / "o" / "samples.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(small_model)
    model = AutoModelForCausalLM.from_pretrained(small_model).eval()
    for i, p in enumerate(PROBLEMS):
        enc = tok(f"{p['problem']}\n{INSTRUCTION}", return_tensors="pt", add_special_tokens=False)
        torch.manual_seed((4 << 32) + 2 * i)
        out = model.generate(**enc, do_sample=True, num_return_sequences=2, max_new_tokens=5, temperature=1.3,
                             top_p=0.9, top_k=0, pad_token_id=tok.pad_token_id)
        want = []
        for row in out[:, enc["input_ids"].shape[1]:].tolist():
            ids = row[:next((j for j, t in enumerate(row) if t in (tok.eos_token_id, tok.pad_token_id)), len(row))]
            want.append(tok.decode(ids, skip_special_tokens=True))
        assert [r["response"] for r in rows if r["problem_id"] == p["id"]] == want


# --------------------------------------------------------------------------------------------------
# point 3: a prompt longer than the context is not attempted; truncations are counted
# --------------------------------------------------------------------------------------------------

LONG = {"id": "long", "problem": "What is 1+1? " * 40, "answer": "2"}


def test_vllm_over_long_prompt_and_context_cut(small_model, small_tok, tmp_path, monkeypatch):
    tok = small_tok
    rows = [PROBLEMS[0], LONG, PROBLEMS[2]]
    prompt_len = {r["id"]: len(tok(f"{r['problem']}\n{INSTRUCTION}", add_special_tokens=False)["input_ids"])
                  for r in rows}
    context = max(prompt_len["p1"], prompt_len["p3"]) + 10
    assert prompt_len["long"] >= context
    answers = {r["problem"]: r["answer"] for r in rows}
    # sample 0 answers right and stops; sample 1 never stops: cut where the context ends
    model = scripted(tok, lambda prompt, j: f"\\boxed{{{answers[prompt.split(chr(10))[0]]}}}" if j == 0 else "1 2",
                     eos=True)

    def two_kinds(child):
        return model(child) if child.index == 0 else scripted(tok, lambda p, j: "1 2", eos=False)(child)

    module, calls = make_vllm(two_kinds, max_model_len=context)
    monkeypatch.setitem(sys.modules, "vllm", module)
    data = write_problems(tmp_path / "three.jsonl", rows)
    args = ["eval", "--bench", "aime25", "--model", str(small_model), "--data-file", str(data), "--backend", "vllm",
            "--k", "2", "--max-tokens", "500", "--out", str(tmp_path / "o")]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, (res.output, res.exception)
    warnings = [x for x in res.stderr.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 2
    assert "max tokens 500 plus the longest prompt" in warnings[0] and f"context of {context} tokens" in warnings[0]
    assert "problem long:" in warnings[1] and "not attempted" in warnings[1]
    assert len(calls["requests"]) == 2  # the long prompt never reached the engine
    recs = [json.loads(x) for x in (tmp_path / "o" / "samples.jsonl").read_text().splitlines()]
    assert [(r["problem_id"], r["sample_idx"]) for r in recs] == [(p, j) for p in ("p1", "long", "p3") for j in (0, 1)]
    long_recs = [r for r in recs if r["problem_id"] == "long"]
    assert all(r["not_attempted"] and not r["correct"] and r["num_tokens"] == 0 for r in long_recs)
    for r in recs:
        if r["problem_id"] != "long":
            assert r["truncated"] == (r["sample_idx"] == 1)
            if r["truncated"]:  # cut where prompt + response reach the context
                assert r["num_tokens"] == context - prompt_len[r["problem_id"]]
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert s["not_attempted"] == 1 and s["not_attempted_ids"] == ["long"]
    assert s["truncated"] == 0.5  # 2 of the 4 attempted samples
    assert s["avg_at_k"] == pytest.approx((0.5 + 0 + 0.5) / 3)  # the long problem scores 0
    md = (tmp_path / "o" / "summary.md").read_text()
    assert "| truncated (share of attempted samples) | 0.5000 |" in md and "not attempted" in md
    # --resume over the finished run keeps every sample and the same summary
    res = CliRunner().invoke(app, [*args, "--resume"])
    assert res.exit_code == 0 and len(calls["requests"]) == 2
    again = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert {k: again[k] for k in ("truncated", "not_attempted", "avg_at_k")} == \
        {k: s[k] for k in ("truncated", "not_attempted", "avg_at_k")}


def test_hf_over_long_prompt_and_context_cut(small_model, small_tok, tmp_path):
    short = tmp_path / "short-context"
    short.mkdir()
    for f in small_model.iterdir():
        (short / f.name).write_bytes(f.read_bytes())
    rows = [PROBLEMS[0], LONG, PROBLEMS[2]]
    prompt_len = {r["id"]: len(small_tok(f"{r['problem']}\n{INSTRUCTION}", add_special_tokens=False)["input_ids"])
                  for r in rows}
    context = max(prompt_len["p1"], prompt_len["p3"]) + 6
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = context
    (short / "config.json").write_text(json.dumps(cfg))
    data = write_problems(tmp_path / "three.jsonl", rows)
    res = subprocess.run([sys.executable, "-m", "stare.cli.main", "eval", "--bench", "aime25", "--model", str(short),
                          "--data-file", str(data), "--backend", "hf", "--k", "3", "--max-tokens", "50",
                          "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    warnings = [x for x in res.stderr.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 2 and "problem long:" in warnings[1]
    recs = [json.loads(x) for x in (tmp_path / "o" / "samples.jsonl").read_text().splitlines()]
    tried = [r for r in recs if r["problem_id"] != "long"]
    for r in tried:  # never past the context; truncated exactly when the context is full
        room = context - prompt_len[r["problem_id"]]
        assert r["num_tokens"] <= room and r["truncated"] == (r["num_tokens"] == room)
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert s["not_attempted"] == 1 and s["not_attempted_ids"] == ["long"]
    assert s["truncated"] == pytest.approx(sum(r["truncated"] for r in tried) / len(tried)) and s["truncated"] > 0
