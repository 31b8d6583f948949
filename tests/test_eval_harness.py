"""`stare eval` end to end on the HF backend with a tiny random model, resume, and the summary's numbers."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from stare.eval.data import Problem
from stare.eval.harness import run_eval
from stare.eval.protocols import Protocol
from tiny_models import build_tiny_model


def stare(*args):
    return subprocess.run([sys.executable, "-m", "stare.cli.main", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random Llama with a BPE tokenizer trained here with `tokenizers` (no download)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "mini.jsonl"
    rows = [{"id": "p1", "problem": "What is 1+1?", "answer": "2"},
            {"id": "p2", "problem": "What is 2+3?", "answer": "5"},
            {"id": "p3", "problem": "Find 033.", "answer": "33"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_end_to_end_and_resume(tiny_model, data_file, tmp_path):
    out = tmp_path / "ev"
    args = ["eval", "--bench", "aime25", "--model", str(tiny_model), "--data-file", str(data_file), "--k", "2",
            "--max-tokens", "6", "--backend", "hf", "--out", str(out)]
    res = stare(*args)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = (out / "samples.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    assert len(rows) == 6
    assert {"problem_id", "sample_idx", "response", "extracted", "correct", "num_tokens"} <= set(rows[0])
    assert [(r["problem_id"], r["sample_idx"]) for r in rows] == [(p, i) for p in ("p1", "p2", "p3") for i in (0, 1)]
    assert all(0 <= r["num_tokens"] <= 6 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bench"] == "aime25" and summary["k"] == 2 and summary["n_problems"] == 3
    assert summary["protocol"]["name"] == "stare" and summary["protocol"]["temperature"] == 1.0
    assert summary["protocol"]["top_p"] == 0.7 and summary["protocol"]["max_tokens"] == 6
    assert {"avg_at_k", "pass_at_k", "maj_at_k", "ci95", "versions"} <= set(summary)
    assert summary["versions"]["transformers"] and (out / "summary.md").exists()
    # a second run without --resume changes nothing
    assert stare(*args).returncode == 2 and (out / "samples.jsonl").read_text().splitlines() == lines
    # a run killed mid-problem: one problem complete, one half-written, a cut line; resume redoes the rest
    (out / "samples.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])
    res = stare(*args, "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert (out / "samples.jsonl").read_text().splitlines() == lines
    again = json.loads((out / "summary.json").read_text())
    for key in ("avg_at_k", "pass_at_k", "maj_at_k", "ci95", "mean_response_tokens"):
        assert again[key] == summary[key]


class ScriptedBackend:
    """Returns fixed responses per problem, so the summary can be checked by hand."""

    name = "scripted"

    def __init__(self, answers):
        self.answers = answers

    def prompt_text(self, problem, instruction):
        return problem

    def generate(self, prompt, n, proto, seed):
        return [(f"so \\boxed{{{a}}}" if a is not None else "no idea", 4) for a in self.answers[prompt]]


def test_summary_numbers_by_hand(tmp_path):
    problems = [Problem("a", "qa", "12"), Problem("b", "qb", "7"), Problem("c", "qc", "1/2")]
    backend = ScriptedBackend({"qa": ["12", "012", "13", None],      # 2 of 4 right; majority 12 (right)
                               "qb": ["8", "8", "7", "9"],           # 1 of 4; majority 8 (wrong)
                               "qc": ["0.5", "\\frac12", "1/2", "2"]})  # 3 of 4; majority 0.5 (right)
    proto = Protocol("stare", 4, 1.0, 0.7, 16)
    s = run_eval(problems, backend, proto, tmp_path, bench="aime24", model="scripted", seed=0, resume=False)
    assert s["avg_at_k"] == pytest.approx((2 / 4 + 1 / 4 + 3 / 4) / 3)
    assert s["pass_at_k"] == pytest.approx(1.0)  # every problem has a right sample among its 4
    assert s["maj_at_k"] == pytest.approx(2 / 3)
    lo, hi = s["ci95"]["avg_at_k"]
    assert 0.25 <= lo <= s["avg_at_k"] <= hi <= 0.75
    assert s["mean_response_tokens"] == 4


@pytest.mark.parametrize("args, message", [
    (["--bench", "aime26", "--model", "x/y"], "unknown bench 'aime26'; valid benches: aime24, aime25"),
    (["--bench", "aime25"], "--model is required"),
    (["--bench", "aime25", "--model", "x/y", "--protocol", "greedy"], "unknown protocol 'greedy'"),
])
def test_bad_input_one_line_exit_2(tmp_path, args, message):
    res = stare("eval", *args, "--out", str(tmp_path / "o"))
    assert res.returncode == 2, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in res.stderr


def test_malformed_data_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "x", "answer": "1"}\n{not json\n')
    res = stare("eval", "--bench", "aime24", "--model", "x/y", "--data-file", str(bad), "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and "bad.jsonl:2: malformed JSON line" in res.stderr and "Traceback" not in res.stderr


def test_eval_of_a_training_run_uses_its_final_checkpoint(tmp_path, data_file):
    run = tmp_path / "run"
    sets = ["steps=1", "warmstart_steps=5", "eval_problems=4", "prompts_per_step=2", "samples_per_prompt=2",
            "train_problems=50"]
    res = stare("train", "--preset", "tiny-cpu", "--algo", "grpo", "--out", str(run), *sum((["--set", s] for s in sets), []))
    assert res.returncode == 0, res.stderr[-2000:]
    res = stare("eval", "--bench", "aime24", "--out", str(run), "--data-file", str(data_file), "--k", "2",
                "--max-tokens", "4", "--backend", "hf")
    # the tiny model's 64-token context fits none of the boxed-answer prompts: one line naming the model (the run's
    # final/), not every problem "not attempted" and a warning about empty responses; nothing written
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert f"--model {run / 'final'}: its context of 64 tokens fits no problem" in lines[0], lines[0]
    assert "empty" not in res.stderr and not (run / "eval-aime24").exists()


class ContextBackend:
    """Fixed samples with ``truncated`` flags; problem "qlong" does not fit the (stated) context."""

    name = "scripted"
    context_length = 100

    def __init__(self):
        self.calls = []

    def prompt_text(self, problem, instruction):
        return problem

    def prompt_tokens(self, prompt):
        return 150 if prompt == "qlong" else 10

    def generate(self, prompt, n, proto, seed):
        from stare.eval.backends import PromptTooLong

        self.calls.append(prompt)
        if prompt == "qlong":
            raise PromptTooLong(150, 100)
        flags = {"qa": [False, True, True, False], "qb": [True, False, False, False]}[prompt]
        return [(f"\\boxed{{{i}}}", 90 if cut else 5, {"truncated": cut}) for i, cut in enumerate(flags)]


def test_not_attempted_and_truncated_by_hand(tmp_path):
    from stare.eval.harness import run_eval
    from stare.eval.protocols import Protocol

    problems = [Problem("a", "qa", "1"), Problem("long", "qlong", "7"), Problem("b", "qb", "0")]
    proto = Protocol("stare", 4, 1.0, 0.7, 90)
    warnings = []
    s = run_eval(problems, ContextBackend(), proto, tmp_path, bench="aime24", model="m", seed=0, resume=False,
                 warn=warnings.append)
    # one warning before sampling (150 + 90 > 100), one for the problem that does not fit
    assert len(warnings) == 2 and "longest prompt (150 tokens, problem long)" in warnings[0]
    assert warnings[1].startswith("problem long:") and "not attempted" in warnings[1]
    assert s["not_attempted"] == 1 and s["not_attempted_ids"] == ["long"]
    assert s["truncated"] == pytest.approx(3 / 8)  # 2 of qa's 4 and 1 of qb's 4; the long problem not counted
    assert s["avg_at_k"] == pytest.approx((1 / 4 + 0 + 1 / 4) / 3)  # sample 1 of a, sample 0 of b; long scores 0
    assert s["mean_response_tokens"] == pytest.approx((3 * 90 + 5 * 5) / 8)  # over the 8 generated samples
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["not_attempted"] for r in rows if r["problem_id"] == "long"] == [True] * 4
    # resume: samples written before these fields existed (no truncated / not_attempted) still summarise
    old = [{k: v for k, v in r.items() if k not in ("truncated", "not_attempted")} for r in rows
           if r["problem_id"] == "a"]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    backend = ContextBackend()
    s2 = run_eval(problems, backend, proto, tmp_path, bench="aime24", model="m", seed=0, resume=True,
                  warn=warnings.append)
    assert backend.calls == ["qlong", "qb"]  # a was kept
    assert s2["truncated"] == pytest.approx(1 / 8) and s2["not_attempted"] == 1  # a's old rows: not truncated
    assert s2["avg_at_k"] == s["avg_at_k"]


# issue 58 item 3: a k that cannot be held is one line before anything is written, and a failed start blocks no retry

def test_a_k_no_machine_holds_is_one_line_and_nothing_is_written(tiny_model, data_file, tmp_path):
    """`stare eval --k 1000000000 --limit 1` (the issue's 1e8, ten times over so that no test machine holds it): one
    line, exit 2, no folder; before the fix a 70-line `can't allocate memory` traceback, a record and an empty
    samples.jsonl."""
    out = tmp_path / "ev"
    res = stare("eval", "--bench", "aime25", "--model", str(tiny_model), "--data-file", str(data_file), "--k",
                "1000000000", "--limit", "1", "--max-tokens", "6", "--backend", "hf", "--out", str(out))
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert lines[0].startswith("error: --k 1000000000: a problem's 1000000000 samples") and "or less" in lines[0]
    assert not out.exists()


def test_check_capacity_bounds_by_hand():
    from stare.eval.harness import SAMPLE_BYTES, check_capacity
    from stare.eval.record import EvalRefused

    check_capacity(1000, 3, 1000 * SAMPLE_BYTES)  # exactly enough
    with pytest.raises(EvalRefused, match=r"^--k 1001: a problem's 1001 samples .* use --k 1000 or less"):
        check_capacity(1001, 3, 1000 * SAMPLE_BYTES)
    check_capacity(10**9, 1, None)  # memory unknown: not checked
    # one run's seeds: problem i's samples take seeds [i k, (i + 1) k) of a block of 2**32
    check_capacity(2**32 // 3, 3, None)
    with pytest.raises(EvalRefused, match=rf"^--k {2**32 // 3 + 1}: 3 problem\(s\) x .* use --k {2**32 // 3} or"):
        check_capacity(2**32 // 3 + 1, 3, None)


def test_the_hf_batch_floor_is_the_tensors_generate_allocates(tiny_model):
    """HFBackend.problem_bytes against the real tensors of one problem's batch: input ids, attention mask, the ids
    generate returns (at their longest) and a step's scores (twice: the model's and the sampler's), read off a real
    generate call."""
    from stare.eval.backends import HFBackend

    backend = HFBackend(str(tiny_model))
    proto = Protocol("stare", 3, 1.0, 0.7, 5)
    seen = {}
    real = backend.model.generate

    def spy(**kw):
        seen["ids"], seen["mask"] = kw["input_ids"].nbytes, kw["attention_mask"].nbytes
        sampler = kw["logits_processor"][0]

        def watch(input_ids, scores, _call=sampler.__call__):
            seen["scores"] = scores.nbytes
            return _call(input_ids, scores)

        kw["logits_processor"] = [watch]
        out = real(**kw)
        full = kw["input_ids"].shape[1] + kw["max_new_tokens"]  # the ids returned, at the longest generate may make
        assert out.shape[1] <= full
        seen["out"] = out.shape[0] * full * out.element_size()
        return out

    backend.model.generate = spy
    prompt = backend.prompt_text("What is 1+1?", proto.instruction)
    backend.generate(prompt, proto.k, proto, 7)
    n_prompt = backend.prompt_tokens(prompt)
    assert backend.problem_bytes(n_prompt, proto.k, proto) == (seen["ids"] + seen["mask"] + seen["out"]
                                                               + 2 * seen["scores"])


class FailingBackend:
    """Fails as the first problem is generated (as the HF backend's `can't allocate memory` did)."""

    name = "failing"

    def prompt_text(self, problem, instruction):
        return problem

    def generate(self, prompt, n, proto, seed):
        raise RuntimeError("can't allocate memory")


def test_a_failed_start_leaves_nothing_and_the_retry_starts_afresh(tmp_path):
    problems = [Problem("a", "qa", "12"), Problem("b", "qb", "7")]
    out = tmp_path / "ev"
    with pytest.raises(RuntimeError, match="allocate"):
        run_eval(problems, FailingBackend(), Protocol("stare", 64, 1.0, 0.7, 16), out, bench="aime24", model="m",
                 seed=0, resume=False)
    assert not (out / "eval_settings.json").exists() and not (out / "samples.jsonl").exists()
    # what an older failed start left (a record with the refused k, an empty samples file): a fresh start for a
    # corrected run, with --resume as without
    from stare.eval.record import check_resume, eval_record, holds_samples

    stale = eval_record(Protocol("stare", 10**8, 1.0, 0.7, 16), seed=0, model="m", bench="aime24")
    for resume in (False, True):
        (out / "eval_settings.json").write_text(json.dumps(stale))
        (out / "samples.jsonl").write_text("")
        assert not holds_samples(out)
        backend = ScriptedBackend({"qa": ["12", "13"], "qb": ["7", "7"]})
        s = run_eval(problems, backend, Protocol("stare", 2, 1.0, 0.7, 16), out, bench="aime24", model="m", seed=0,
                     resume=resume)
        assert s["avg_at_k"] == pytest.approx((1 / 2 + 2 / 2) / 2)
        assert json.loads((out / "eval_settings.json").read_text())["k"] == 2
        assert len((out / "samples.jsonl").read_text().splitlines()) == 4
        (out / "summary.json").unlink()
    # a samples file whose only line was cut by a kill holds no sample either; a whole line does
    (out / "samples.jsonl").write_text('{"problem_id": "a", "sample_idx": 0')
    assert not holds_samples(out)
    check_resume(out, eval_record(Protocol("stare", 3, 1.0, 0.7, 16), seed=0, model="m", bench="aime24"))
    (out / "samples.jsonl").write_text('{"problem_id": "a", "sample_idx": 0}\n')
    assert holds_samples(out)


def test_the_cli_retry_after_a_failed_start_is_not_refused(tiny_model, data_file, tmp_path):
    """The issue's second half: a folder with a record of k 100000000 and an empty samples.jsonl (what the failed
    start wrote) was refused ("already holds samples; pass --resume", and --resume refused the new k)."""
    out = tmp_path / "ev"
    args = ["eval", "--bench", "aime25", "--model", str(tiny_model), "--data-file", str(data_file), "--limit", "1",
            "--max-tokens", "4", "--backend", "hf", "--out", str(out)]
    from stare.eval.record import eval_record

    for extra in ([], ["--resume"]):
        out.mkdir(exist_ok=True)
        (out / "eval_settings.json").write_text(json.dumps(eval_record(
            Protocol("stare", 10**8, 1.0, 0.7, 4), seed=0, model=str(tiny_model), bench="aime25")))
        (out / "samples.jsonl").write_text("")
        res = stare(*args, "--k", "2", *extra)
        assert res.returncode == 0, res.stderr[-2000:]
        assert json.loads((out / "eval_settings.json").read_text())["k"] == 2
        assert len((out / "samples.jsonl").read_text().splitlines()) == 2
        for f in out.iterdir():
            f.unlink()
