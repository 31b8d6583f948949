"""The shipped lm-eval tasks and `stare eval --harness lm-eval`: scoring hooks, and a run of lm-eval's HF model on a
tiny trained Llama whose avg@k is checked against a recomputation from lm-eval's own sample log."""
import json
import re
import subprocess
import sys

import pytest

from tiny_models import COMPLETIONS, INSTRUCTION, PROBLEMS, build_tiny_model, write_problems

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'lm-eval==0.4.13')")

from stare.eval.lm_eval_tasks import TASKS_DIR  # noqa: E402
from stare.eval.lm_eval_tasks import utils  # noqa: E402


def stare(*args):
    return subprocess.run([sys.executable, "-m", "stare.cli.main", *args], capture_output=True, text=True)


# ---- the hooks ---------------------------------------------------------------------------------------------------
def test_process_results_scores_every_sample_with_math_verify():
    # "033" vs 33: right here, wrong for lm-eval's own aime task (string comparison of its first sample only)
    r = utils.process_results({"answer": "33"}, [["so \\boxed{033}", "\\boxed{34}", "no box", "\\boxed{33}"]])
    assert r == {"avg_at_k": 2 / 4, "pass_at_k": 1.0, "maj_at_k": 1.0}  # majority: "033" (first of the 1-1 tie)
    from lm_eval.tasks.aime import utils as lm_eval_aime

    assert lm_eval_aime.process_results({"Answer": "33"}, ["so \\boxed{033}"])["exact_match"] == 0

    half = {"answer": "\\frac{1}{2}"}
    assert utils.process_results(half, [["\\boxed{0.5}", "\\boxed{\\frac12}", "\\boxed{1/2}", "\\boxed{2}"]]) == \
        {"avg_at_k": 3 / 4, "pass_at_k": 1.0, "maj_at_k": 1.0}
    assert utils.process_results({"answer": "0.5"}, [["\\boxed{\\frac12}"]])["avg_at_k"] == 1.0
    wrong = utils.process_results({"answer": "7"}, [["\\boxed{8}", "\\boxed{8}", "\\boxed{7}"]])
    assert wrong == {"avg_at_k": 1 / 3, "pass_at_k": 1.0, "maj_at_k": 0.0}  # majority 8 is wrong
    # a take-first style filter hands over one string per request: scored as one sample
    assert utils.process_results({"answer": "5"}, ["\\boxed{5}"])["avg_at_k"] == 1.0


def test_process_docs_normalises_fields_and_repairs_escapes():
    import datasets

    ds = datasets.Dataset.from_list([{"Problem": "\x0crac{1}{2} of x", "Answer": 33, "ID": "2024-I-1"},
                                     {"Problem": "y", "Answer": 7, "ID": ""}])
    docs = list(utils.process_docs(ds))
    assert docs == [{"id": "2024-I-1", "problem": "\\frac{1}{2} of x", "answer": "33"},
                    {"id": "1", "problem": "y", "answer": "7"}]
    assert utils.doc_to_text(docs[1]) == "y\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert utils.keep_all([["a", "b"]], [{}]) == [["a", "b"]]


def test_shipped_tasks_are_registered_and_keep_every_sample():
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    assert {"stare_aime24", "stare_aime25"} <= set(tm.all_tasks)
    from lm_eval.tasks._yaml_loader import load_yaml

    for bench, repo, split in (("aime24", "HuggingFaceH4/aime_2024", "train"), ("aime25", "math-ai/aime25", "test")):
        cfg = load_yaml(TASKS_DIR / f"stare_{bench}.yaml", resolve_func=False)  # with its include merged
        assert (cfg["task"], cfg["dataset_path"], cfg["test_split"]) == (f"stare_{bench}", repo, split)
        assert cfg["repeats"] == 32 and cfg["generation_kwargs"]["until"] == []
        (only_filter,) = cfg["filter_list"]
        assert [f["function"] for f in only_filter["filter"]] == ["custom"]
        assert only_filter["filter"][0]["filter_fn"].endswith("utils.keep_all")
        assert cfg["process_results"].endswith("utils.process_results")


@pytest.mark.parametrize("bench", ["aime24", "aime25"])
def test_task_docs_equal_the_stare_harness_problems(bench):
    """On the packaged AIME copies: the lm-eval task's documents are the problems `stare eval` reads from that file."""
    from stare.eval.data import packaged_data_file

    path = packaged_data_file(bench)
    assert path is not None
    import datasets

    from stare.eval import load_bench

    docs = list(utils.process_docs(datasets.load_dataset("json", data_files={"test": str(path)})["test"]))
    assert docs == [{"id": p.id, "problem": p.problem, "answer": p.answer} for p in load_bench(bench, data_file=path)]
    assert len(docs) == 30 and all(0 <= int(d["answer"]) <= 999 for d in docs)


# ---- a run through lm-eval's HF model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def boxed_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("boxed-model"), train=True)


def _boxed_int(text):
    """Independent of stare.eval: the integer in the last \\boxed{...}, or None."""
    found = re.findall(r"\\boxed\{(\d+)\}", text)
    return int(found[-1]) if found else None


def test_lm_eval_run_matches_a_recomputation_from_its_sample_log(boxed_model, tmp_path):
    data = write_problems(tmp_path / "mini.jsonl")
    out = tmp_path / "ev"
    k = 6
    res = stare("eval", "--harness", "lm-eval", "--bench", "aime24", "--model", str(boxed_model), "--data-file",
                str(data), "--k", str(k), "--top-p", "1.0", "--max-tokens", "12", "--backend", "hf", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    gold = {r["id"]: int(r["answer"]) for r in PROBLEMS}

    # lm-eval's own sample log: one record per problem, with all k responses after the keep_all filter
    log = [json.loads(line) for line in (out / "lm_eval_samples.jsonl").read_text().splitlines()]
    assert sorted(s["doc"]["id"] for s in log) == sorted(gold)
    per_problem, any_right = {}, {}
    for s in log:
        responses = s["filtered_resps"][0] if isinstance(s["filtered_resps"][0], list) else s["filtered_resps"]
        assert len(responses) == k and len(s["resps"][0]) == k
        right = [_boxed_int(r) == gold[s["doc"]["id"]] for r in responses]
        per_problem[s["doc"]["id"]] = sum(right) / k
        any_right[s["doc"]["id"]] = any(right)
    expected = sum(per_problem.values()) / len(per_problem)
    assert 0 < expected < 1  # the trained model answers 2, 5 or 033 after every problem: neither all right nor wrong
    assert summary["avg_at_k"] == pytest.approx(expected)
    assert summary["pass_at_k"] == pytest.approx(sum(any_right.values()) / len(any_right))
    assert {r["id"]: r["accuracy"] for r in summary["per_problem"]} == pytest.approx(per_problem)
    # the "033" answers were produced and scored right for the problem whose answer is 33
    p3 = [r for s in log if s["doc"]["id"] == "p3" for r in s["filtered_resps"][0]]
    assert any("\\boxed{033}" in r for r in p3) and per_problem["p3"] > 0
    assert all(r in COMPLETIONS for s in log for r in s["filtered_resps"][0])
    # the prompt lm-eval sent is the stare harness's (no chat template on this tokenizer)
    assert all(s["arguments"][0][0] == f"{s['doc']['problem']}\n{INSTRUCTION}" for s in log)

    assert summary["harness"] == "lm-eval" and summary["bench"] == "aime24" and summary["model"] == str(boxed_model)
    assert summary["k"] == k and summary["n_problems"] == 3 and summary["versions"]["lm-eval"] == "0.4.13"
    assert summary["protocol"] == {"name": "stare", "k": k, "temperature": 1.0, "top_p": 1.0, "max_tokens": 12,
                                   "instruction": utils.BOXED_INSTRUCTION}
    # what lm-eval actually ran: repeats = k, the protocol's sampling settings, the local file
    config = json.loads((out / "lm_eval_results.json").read_text())["configs"]["stare_aime24"]
    assert config["repeats"] == k and config["dataset_path"] == "json"
    gen = config["generation_kwargs"]
    assert (gen["temperature"], gen["top_p"], gen["max_gen_toks"], gen["do_sample"]) == (1.0, 1.0, 12, True)
    # samples.jsonl: the same responses, one line per sample
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * k and {(r["problem_id"], r["sample_idx"]) for r in rows} == \
        {(p, j) for p in gold for j in range(k)}
    by_id = {s["doc"]["id"]: s["filtered_resps"][0] for s in log}
    assert all(r["response"] == by_id[r["problem_id"]][r["sample_idx"]] for r in rows)


@pytest.mark.parametrize("args, message", [
    (["--harness", "helm"], "unknown harness 'helm'; valid harnesses: stare, lm-eval"),
    (["--harness", "lm-eval", "--bench", "math500"], "--harness lm-eval has tasks for aime24, aime25 only"),
    (["--harness", "lm-eval", "--resume"], "--resume works with --harness stare only"),
])
def test_bad_harness_input_one_line_exit_2(tmp_path, args, message):
    if "--bench" not in args:
        args = [*args, "--bench", "aime24"]
    res = stare("eval", *args, "--model", "x/y", "--out", str(tmp_path / "o"))
    assert res.returncode == 2, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in res.stderr
    assert not (tmp_path / "o").exists()


def test_the_tasks_metric_list_is_the_metric_tables():
    """lm-eval aggregates what a task's metric_list names: it lists every per-problem metric of
    stare.eval.metrics.METRICS (what process_results returns), each a mean, higher better."""
    from lm_eval.tasks._yaml_loader import load_yaml

    from stare.eval.metrics import problem_metrics

    cfg = load_yaml(TASKS_DIR / "_stare_aime_base.yaml", resolve_func=False)
    assert [m["metric"] for m in cfg["metric_list"]] == [m.key for m in problem_metrics()]
    assert all(m["aggregation"] == "mean" and m["higher_is_better"] is True for m in cfg["metric_list"])
    assert set(utils.process_results({"answer": "1"}, [["\\boxed{1}"]])) == {m.key for m in problem_metrics()}
