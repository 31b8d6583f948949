"""`stare eval --engines N` with real Ray on CPU: HF-backend engines in Ray actors draw the same samples as one
engine in this process, a killed engine's problems are redone on the other, and losing every engine stops the run
with one line and the finished problems kept for `--resume`; both with each engine's share in flight at once
(`--batching all`) and one problem at a time (`problem`).

The reference samples are computed here without the harness: transformers' `generate` with the seed the docs
give for problem i, `(seed mod 2**31) * 2**32 + i * k`.
"""
from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager
from functools import partial

import pytest

ray = pytest.importorskip("ray")

from stare.eval.data import Problem  # noqa: E402
from stare.eval.backends import HFBackend  # noqa: E402
from stare.eval.harness import run_eval
from stare.eval.protocols import Protocol
from tiny_models import build_tiny_model  # noqa: E402

K, MAX_TOKENS, SEED = 3, 8, 5
PROTO = Protocol("stare", K, 1.0, 0.7, MAX_TOKENS)
QUESTIONS = ["What is 1+1?", "What is 2+3?", "Find 033.", "What is 7 times 6?", "What is 1+1?", "Name 12.",
             "What is 9-4?", "Find 5.", "What is 3+3?", "Name 0."]
# p0 and p4: one question, two seeds. Ten problems: when an engine is killed after the first new one completes,
# problems are still waiting, so the dead engine is handed one and its death is seen
PROBLEMS = [Problem(f"p{i}", q, "2") for i, q in enumerate(QUESTIONS)]


@contextmanager
def one_thread():
    """In-process generation on one torch thread, as each engine's actor runs (Ray sets OMP_NUM_THREADS=1 there):
    on a busy 2-core machine two threads wait on each other for most of the time."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def stare(*args):
    return subprocess.run([sys.executable, "-m", "stare.cli.main", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def reference(model) -> dict:
    """(problem id, sample index) -> (response, num_tokens), from transformers directly."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with one_thread():
        return generated(tok, lm)


def generated(tok, lm) -> dict:
    import torch

    want = {}
    for i, p in enumerate(PROBLEMS):
        ids = tok(f"{p.problem}\n{PROTO.instruction}", return_tensors="pt", add_special_tokens=False)
        torch.manual_seed((SEED % 2**31) * 2**32 + i * K)
        with torch.no_grad():
            out = lm.generate(**ids, do_sample=True, num_return_sequences=K, max_new_tokens=MAX_TOKENS,
                              temperature=1.0, top_p=0.7, top_k=0, pad_token_id=tok.pad_token_id)
        for j, row in enumerate(out[:, ids["input_ids"].shape[1]:].tolist()):
            end = next((n for n, t in enumerate(row) if t in (tok.eos_token_id, tok.pad_token_id)), len(row))
            cut = row[:end]  # up to the EOS (or the padding after it), not counted
            want[(p.id, j)] = (tok.decode(cut, skip_special_tokens=True), len(cut))
    return want


@pytest.fixture(scope="module")
def one_engine(model, tmp_path_factory):
    """The evaluation on one engine, in this process (no Ray): its output folder."""
    out = tmp_path_factory.mktemp("one-engine")
    with one_thread():
        run_eval(PROBLEMS, HFBackend(str(model)), PROTO, out, bench="aime25", model=str(model), seed=SEED,
                 resume=False)
    return out


def drawn(path) -> dict:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    keys = [(r["problem_id"], r["sample_idx"]) for r in rows]
    assert len(keys) == len(set(keys)), "a sample written twice"
    return {(r["problem_id"], r["sample_idx"]): (r["response"], r["num_tokens"]) for r in rows}


@pytest.fixture(scope="module")
def cluster():
    """A small local Ray (two CPU slots) for the in-process pools; ended after the module."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def factory(model, batching="problem"):
    """What ``stare eval`` builds in each actor; with ``all``, HF batches of one problem each (a problem's prompt
    and response here are under 40 tokens), so an engine hands its share back a problem at a time and a kill can
    land while it still holds some."""
    from stare.cli.eval_plan import build_engine

    if batching == "all":
        return partial(HFBackend, str(model), K * 40)
    return partial(build_engine, "hf", str(model), 1, SEED)


def test_two_engines_write_the_samples_of_one(model, reference, one_engine, tmp_path):
    """The CLI with --engines 2 (its own local Ray) against one engine in this process: the same samples, the
    reference ones, and the same summary but for ``engines``."""
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"id": p.id, "problem": p.problem, "answer": p.answer}) + "\n"
                            for p in PROBLEMS))
    two = stare("eval", "--bench", "aime25", "--model", str(model), "--data-file", str(data), "--k", str(K),
                "--max-tokens", str(MAX_TOKENS), "--backend", "hf", "--seed", str(SEED), "--out", str(tmp_path / "two"),
                "--engines", "2")
    assert two.returncode == 0, two.stderr[-3000:]
    assert "warning" not in two.stderr.lower(), two.stderr  # no Ray start-up noise on the terminal
    assert drawn(one_engine / "samples.jsonl") == reference
    assert drawn(tmp_path / "two" / "samples.jsonl") == reference
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one_engine, tmp_path / "two"))
    assert (s1.pop("engines"), s2.pop("engines")) == (1, 2)
    assert s1 == s2
    assert "backend hf x 2 engines" in (tmp_path / "two" / "summary.md").read_text()
    # p0 and p4 ask the same question: their samples differ because their seeds do
    assert [reference[("p0", j)] for j in range(K)] != [reference[("p4", j)] for j in range(K)]


@pytest.mark.parametrize("batching", ["all", "problem"])
def test_a_killed_engine_s_problems_are_redone_on_the_other(cluster, model, reference, tmp_path, batching):
    """Resume a folder holding p0 and p1 with two engines, one of them killed after the first new problem: one
    warning, every sample once, the reference samples (so resumed problems keep their own positions' seeds)."""
    from stare.eval.engines import EnginePool

    out = tmp_path / "ev"
    out.mkdir()
    kept = [json.dumps({"problem_id": pid, "sample_idx": j, "response": reference[(pid, j)][0], "extracted": None,
                        "correct": False, "num_tokens": reference[(pid, j)][1]}) for pid in ("p0", "p1")
            for j in range(K)]
    (out / "samples.jsonl").write_text("\n".join(kept) + "\n")
    from stare.eval.record import RECORD, eval_record

    (out / RECORD).write_text(json.dumps(eval_record(PROTO, seed=SEED, model=str(model), bench="aime25",
                                                     batching=batching)))
    warnings, calls = [], []
    with EnginePool(factory(model, batching), 2, warn=warnings.append) as pool:
        victim = pool.actors[1]

        def progress(n):
            calls.append(n)
            if len(calls) == 3:  # p0 and p1 (kept), then the first new problem: both engines hold queued work
                ray.kill(victim)

        summary = run_eval(PROBLEMS, pool, PROTO, out, bench="aime25", model=str(model), seed=SEED, resume=True,
                           progress=progress, warn=warnings.append, batching=batching)
        alive = pool.alive
    assert [w for w in warnings if "died" in w] == [w for w in warnings if w.startswith("engine 2 of 2 died")]
    assert len([w for w in warnings if "died" in w]) == 1 and alive == {0}
    lines = (out / "samples.jsonl").read_text().splitlines()
    assert lines[: len(kept)] == kept  # the problems on disk were kept, not redone
    assert drawn(out / "samples.jsonl") == reference
    assert summary["engines"] == 2 and summary["n_problems"] == len(PROBLEMS) and sum(calls) == len(PROBLEMS) * K


@pytest.mark.parametrize("batching", ["all", "problem"])
def test_losing_every_engine_stops_with_one_line_and_resume_finishes(cluster, model, reference, tmp_path, batching):
    from stare.eval.engines import EngineError, EnginePool

    out = tmp_path / "ev"
    killed = []
    with EnginePool(factory(model, batching), 2, warn=lambda m: None) as pool:
        def progress(n):
            if not killed:  # once, after the first problem is written
                for actor in pool.actors:
                    ray.kill(actor)
                killed.append(n)

        with pytest.raises(EngineError) as err:
            run_eval(PROBLEMS, pool, PROTO, out, bench="aime25", model=str(model), seed=SEED, resume=False,
                     progress=progress, batching=batching)
    assert str(err.value).startswith("all 2 engines died") and "\n" not in str(err.value)
    written = drawn(out / "samples.jsonl")
    assert 0 < len(written) < len(reference) and all(reference[key] == value for key, value in written.items())
    before = (out / "samples.jsonl").read_text().splitlines()
    with one_thread():
        run_eval(PROBLEMS, HFBackend(str(model)), PROTO, out, bench="aime25", model=str(model), seed=SEED,
                 resume=True, batching=batching)
    assert set(before) <= set((out / "samples.jsonl").read_text().splitlines())  # kept (rewritten in bench order)
    assert drawn(out / "samples.jsonl") == reference


def test_too_few_cpus_is_one_line_before_any_engine_starts(cluster, model):
    from stare.eval.engines import EngineError, EnginePool

    with pytest.raises(EngineError, match=r"^--engines 3 needs 3 CPUs in the Ray cluster; it has 2$"):
        EnginePool(factory(model), 3)


@pytest.mark.parametrize("extra, message", [
    (["--engines", "0"], "--engines 0: expected a number of engines >= 1"),
    (["--engines", "2", "--harness", "lm-eval"], "--engines 2 works with --harness stare only"),
    (["--ray-address", ""], "--ray-address '': expected HOST:PORT"),
])
def test_bad_engine_flags_are_one_line(tmp_path, extra, message):
    res = stare("eval", "--bench", "aime25", "--model", "x/y", "--out", str(tmp_path / "o"), *extra)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1 and message in lines[0], res.stderr


NO_RAY = """
import sys
from stare.cli.main import app
try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    print("ray imported" if "ray" in sys.modules else "ray not imported")
"""


def test_one_engine_does_not_import_ray(model, tmp_path):
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"id": "p0", "problem": "What is 1+1?", "answer": "2"}) + "\n")
    res = subprocess.run([sys.executable, "-c", NO_RAY, "eval", "--bench", "aime25", "--model", str(model),
                          "--data-file", str(data), "--k", "1", "--max-tokens", "2", "--backend", "hf", "--out",
                          str(tmp_path / "o")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines()[-1] == "ray not imported"
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["engines"] == 1


def test_progress_counts_samples_as_the_engine_ends_them(model, tmp_path):
    """The bar counts samples (issue 58): with every problem in one generate call, the HF engine reports rows as they
    draw their end token, before any problem is scored and written; the total is exactly problems x k (rows still
    going at the limit are counted when their problem is written), and the samples are those of a run without a
    bar, byte for byte."""
    proto = Protocol("stare", 6, 1.0, 0.9, 24)
    calls = []

    def progress(n):
        path = tmp_path / "with" / "samples.jsonl"
        calls.append((n, len(path.read_text().splitlines()) if path.exists() else 0))

    with one_thread():
        backend = HFBackend(str(model))
        run_eval(PROBLEMS, backend, proto, tmp_path / "with", bench="aime25", model=str(model), seed=SEED,
                 resume=False, progress=progress, batching="all")
        assert backend.on_samples is None  # handed back
        run_eval(PROBLEMS, backend, proto, tmp_path / "without", bench="aime25", model=str(model), seed=SEED,
                 resume=False, batching="all")
    assert sum(n for n, _ in calls) == len(PROBLEMS) * proto.k
    during = [n for n, written in calls if written == 0]
    assert sum(during) > 0 and any(n < proto.k for n in during), calls  # samples counted one by one, early
    assert (tmp_path / "with" / "samples.jsonl").read_bytes() == (tmp_path / "without" / "samples.jsonl").read_bytes()
