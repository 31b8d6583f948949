"""stare.eval.summary (eval/summary.py): the one summary builder of both eval harnesses (``core_summary``,
``write_summary``, ``summary_markdown``), ``stare eval``'s ``summarise`` with its outcome and tool rows, the printed
line (``scores_line``) and ``read_summary``, against numbers and lines worked by hand."""
import json

import pytest

from stare.eval.data import Problem
from stare.eval.protocols import Protocol
from stare.eval.summary import attempted, outcome_fields, outcome_md, read_summary, scores_line, summarise, \
    write_json_atomic


def test_one_summary_builder_numbers_by_hand(tmp_path):
    """eval.summary (both harnesses' summary.json and summary.md): means by hand, intervals inside the data's range,
    lm-eval's own aggregates kept when given, one atomic write."""
    import json

    from stare.eval.protocols import Protocol
    from stare.eval.summary import core_summary, write_summary

    proto = Protocol("stare", 4, 1.0, 0.7, 16)
    per_problem, per_pass, per_maj = [0.25, 1.0, 0.0], [0.9, 1.0, 0.0], [0.0, 1.0, 0.0]
    per_metric = {"avg_at_k": per_problem, "pass_at_k": per_pass, "maj_at_k": per_maj}
    s = core_summary(bench="aime24", model="m", backend="hf", seed=3, proto=proto, values=per_metric,
                     ids=["a", "b", "c"], answers=["1", "2", "3"])
    assert s["avg_at_k"] == pytest.approx(1.25 / 3) and s["pass_at_k"] == pytest.approx(1.9 / 3)
    assert s["maj_at_k"] == pytest.approx(1 / 3) and s["k"] == 4 and s["n_problems"] == 3
    for key, values in (("avg_at_k", per_problem), ("pass_at_k", per_pass), ("maj_at_k", per_maj)):
        lo, hi = s["ci95"][key]
        assert min(values) <= lo <= s[key] <= hi <= max(values)
    assert s["per_problem"][0] == {"id": "a", "accuracy": 0.25, "answer": "1"}
    assert s["protocol"] == {"name": "stare", "k": 4, "temperature": 1.0, "top_p": 0.7, "max_tokens": 16,
                             "instruction": proto.instruction}
    lm = core_summary(bench="aime24", model="m", backend="hf", seed=3, proto=proto, values=per_metric,
                      ids=["a", "b", "c"], answers=["1", "2", "3"], scores={"avg_at_k": 0.5})
    assert lm["avg_at_k"] == 0.5 and lm["pass_at_k"] == s["pass_at_k"]

    s["mean_response_tokens"] = 12.5
    write_summary(tmp_path, s, title="aime24: m", setup="setup line", extra_rows=[("mean turns", "1.50")])
    assert json.loads((tmp_path / "summary.json").read_text()) == s and not (tmp_path / "summary.json.tmp").exists()
    md = (tmp_path / "summary.md").read_text().splitlines()
    assert md[0] == "# aime24: m" and md[2] == "setup line"
    assert f"| avg@4 | {1.25 / 3:.4f} | [{s['ci95']['avg_at_k'][0]:.4f}, {s['ci95']['avg_at_k'][1]:.4f}] |" in md
    assert "| mean response tokens | 12.5 | |" in md and "| mean turns | 1.50 | |" in md
    assert not any(line.startswith("| reflection") for line in md)  # not measured: no row
    assert md[-3:] == ["| a | 1 | 0.250 |", "| b | 2 | 1.000 |", "| c | 3 | 0.000 |"]


def rec(pid, j, x, tokens, **extra):
    return {"problem_id": pid, "sample_idx": j, "response": f"\\boxed{{{x}}}", "extracted": x, "correct": x == "2",
            "num_tokens": tokens, **extra}


def test_summarise_by_hand_with_a_problem_not_attempted_and_tools(tmp_path):
    problems = [Problem("a", "1+1?", "2"), Problem("b", "a long one", "5")]
    results = {"a": [rec("a", 0, "2", 10, truncated=True, turns=2, tool_calls=1, sandbox_isolation="namespaces"),
                     rec("a", 1, "2", 20, truncated=False, turns=1, tool_calls=0, sandbox_isolation="basic")],
               "b": [{"problem_id": "b", "sample_idx": j, "response": "", "extracted": None, "correct": False,
                      "num_tokens": 0, "not_attempted": True} for j in range(2)]}
    s = summarise(problems, results, Protocol("stare", 2, 1.0, 0.7, 16), bench="aime25", model="m", backend="hf",
                  seed=3, out=tmp_path, tools={"max_turns": 3}, engines=2, batching="all")
    assert (s["avg_at_k"], s["pass_at_k"], s["maj_at_k"]) == (0.5, 0.5, 0.5)  # a: 2 of 2 right; b scores 0
    assert s["mean_response_tokens"] == 15  # (10 + 20) / 2: of the generated samples only
    assert (s["truncated"], s["not_attempted"], s["not_attempted_ids"]) == (0.5, 1, ["b"])  # 1 of a's 2
    assert (s["mean_turns"], s["mean_tool_calls"]) == (3 / 4, 1 / 4)  # over all 4 samples
    assert s["sandbox_isolation"] == "basic/namespaces" and s["tools"] == {"max_turns": 3}
    assert (s["engines"], s["batching"], s["n_problems"], s["k"]) == (2, "all", 2, 2)
    assert json.loads((tmp_path / "summary.json").read_text()) == s
    md = (tmp_path / "summary.md").read_text().splitlines()
    assert md[0] == "# aime25: m"
    assert md[2] == ("protocol stare: k 2, temperature 1.0, top_p 0.7, max tokens 16; backend hf x 2 engines, "
                     "batching all; seed 3; 2 problems")
    for row in ("| truncated (share of attempted samples) | 0.5000 | |",
                "| problems not attempted (prompt longer than the context; scored 0) | 1 (b) | |",
                "| mean turns | 0.75 | |", "| mean tool calls | 0.25 | |", "| sandbox isolation | basic/namespaces | |",
                "| mean response tokens | 15.0 | |", "| a | 2 | 1.000 |", "| b | 5 | 0.000 |"):
        assert row in md, row


def test_outcome_fields_count_attempted_samples_only():
    problems = [Problem("p", "", "1"), Problem("q", "", "1"), Problem("r", "", "1")]
    ordered = [[{"truncated": True}, {}], [{"not_attempted": True}] * 2, [{"truncated": False}, {"truncated": True}]]
    assert attempted(ordered) == [{"truncated": True}, {}, {"truncated": False}, {"truncated": True}]
    fields = outcome_fields(problems, ordered)
    assert fields == {"truncated": 2 / 4, "not_attempted": 1, "not_attempted_ids": ["q"]}
    assert outcome_md(fields) == [("truncated (share of attempted samples)", "0.5000"),
                                  ("problems not attempted (prompt longer than the context; scored 0)", "1 (q)")]
    none_tried = outcome_fields(problems[:1], [[{"not_attempted": True}]])
    assert none_tried == {"truncated": 0.0, "not_attempted": 1, "not_attempted_ids": ["p"]}
    assert outcome_md({"truncated": 0.125, "not_attempted": 0}) == [("truncated (share of attempted samples)",
                                                                     "0.1250")]


def test_scores_line_is_the_printed_metrics():
    summary = {"k": 4, "avg_at_k": 0.5, "pass_at_k": 0.75, "maj_at_k": 0.25, "mean_response_tokens": 12.0}
    assert scores_line(summary) == "avg@4 0.5000  pass@4 0.7500  maj@4 0.2500"


def test_read_summary_and_its_refusals(tmp_path):
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'summary.json'} is not readable JSON"):
        read_summary(tmp_path)  # no file
    (tmp_path / "summary.json").write_text("{cut")
    with pytest.raises(ValueError, match="is not readable JSON"):
        read_summary(tmp_path)
    for bad in ([1], {"bench": 3}, {"k": 2}):
        (tmp_path / "summary.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=r"is malformed: expected a JSON object with a bench name"):
            read_summary(tmp_path)
    write_json_atomic(tmp_path / "summary.json", {"bench": "aime24", "k": 2})
    assert read_summary(tmp_path) == {"bench": "aime24", "k": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
