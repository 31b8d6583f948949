"""Evaluation metrics checked against independent computations (brute force, closed forms, hand counts)."""
import math
import random
from itertools import combinations

import pytest

from stare.eval.metrics import (
    REFLECTION_PHRASES,
    avg_at_k,
    bootstrap_ci,
    count_reflections,
    maj_at_k,
    majority_votes,
    pass_at_k,
    pass_at_k_mean,
    per_problem_accuracy,
    reflection_rate,
)


def brute_pass_at_k(flags, k):
    """Fraction of all k-subsets of the samples holding at least one correct sample."""
    subsets = list(combinations(range(len(flags)), k))
    return sum(any(flags[i] for i in s) for s in subsets) / len(subsets)


# ---- pass@k -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration_of_all_subsets(n):
    for c in range(n + 1):
        flags = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(flags, k), abs=1e-12)


def test_pass_at_k_mean_matches_enumeration():
    rng = random.Random(3)
    correct = [[rng.random() < p for _ in range(7)] for p in (0.0, 0.1, 0.3, 0.5, 0.9, 1.0)]
    for k in range(1, 8):
        expected = sum(brute_pass_at_k(row, k) for row in correct) / len(correct)
        assert pass_at_k_mean(correct, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_1_mean_equals_avg_at_k():
    correct = [[True, False, False, True], [False] * 4, [True] * 4]
    assert pass_at_k_mean(correct, 1) == pytest.approx(avg_at_k(correct))


def test_pass_at_k_mean_rejects_k_above_samples_and_empty_input():
    with pytest.raises(ValueError):
        pass_at_k_mean([[True, False]], 3)
    with pytest.raises(ValueError):
        pass_at_k_mean([], 1)
    with pytest.raises(ValueError):
        pass_at_k_mean([[True], []], 1)


# ---- avg@k ------------------------------------------------------------------------------------------------------

def test_avg_at_k_by_hand():
    correct = [[True, True, False, False], [True, False, False, False], [False] * 4]
    # (2/4 + 1/4 + 0) / 3 = 0.25
    assert avg_at_k(correct) == pytest.approx(0.25)
    assert per_problem_accuracy(correct) == [0.5, 0.25, 0.0]


def test_avg_at_k_weights_problems_equally_with_ragged_samples():
    # 1/1 and 1/4 -> mean of per-problem means is 0.625 (pooled accuracy would be 2/5 = 0.4)
    assert avg_at_k([[True], [True, False, False, False]]) == pytest.approx(0.625)


def test_avg_at_k_rejects_empty():
    with pytest.raises(ValueError):
        avg_at_k([])
    with pytest.raises(ValueError):
        avg_at_k([[]])


# ---- maj@k ------------------------------------------------------------------------------------------------------

def test_maj_at_k_hand_cases():
    extracted = [
        ["5", "5", "7", "5"],     # clear majority 5 (correct)
        ["3", "4", "4", "3"],     # tie 3 vs 4 -> 3 occurs first; 3 is wrong
        ["4", "3", "3", "4"],     # tie -> 4 occurs first; 4 is right
        [None, None, None, "9"],  # None never wins while some answer exists -> 9 (right)
        [None, None, None, None], # no answer at all -> wrong
        ["1", "2", "2", None],    # 2 wins (wrong)
    ]
    correct = [
        [True, True, False, True],
        [False, True, True, False],
        [True, False, False, True],
        [False, False, False, True],
        [False, False, False, False],
        [True, False, False, False],
    ]
    assert majority_votes(extracted, correct) == [True, False, True, True, False, False]
    assert maj_at_k(extracted, correct) == pytest.approx(3 / 6)


def test_maj_at_k_minority_correct_answer_does_not_count():
    assert maj_at_k([["12", "13", "13"]], [[True, False, False]]) == 0.0


def test_maj_at_k_shape_errors():
    with pytest.raises(ValueError):
        maj_at_k([["1"]], [[True], [False]])
    with pytest.raises(ValueError):
        maj_at_k([["1", "2"]], [[True]])


# ---- bootstrap --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.37])
def test_bootstrap_degenerate_interval_is_the_value(value):
    lo, hi = bootstrap_ci([value] * 30, n_boot=500)
    assert lo == pytest.approx(value, abs=1e-12) and hi == pytest.approx(value, abs=1e-12)
    assert lo <= hi


def test_bootstrap_single_problem():
    assert bootstrap_ci([0.5]) == pytest.approx((0.5, 0.5))


def test_bootstrap_binary_data_approaches_normal_interval():
    n, ones = 400, 120  # p = 0.3
    data = [1.0] * ones + [0.0] * (n - ones)
    p = ones / n
    z = 1.959963984540054  # Phi^-1(0.975)
    half = z * math.sqrt(p * (1 - p) / n)  # ~0.0449
    lo, hi = bootstrap_ci(data, n_boot=20000, alpha=0.05, seed=1)
    assert lo == pytest.approx(p - half, abs=0.006)
    assert hi == pytest.approx(p + half, abs=0.006)
    # a 90% interval is narrower and matches z = 1.645
    lo90, hi90 = bootstrap_ci(data, n_boot=20000, alpha=0.10, seed=1)
    half90 = 1.6448536269514722 * math.sqrt(p * (1 - p) / n)
    assert lo < lo90 < hi90 < hi
    assert hi90 - lo90 == pytest.approx(2 * half90, abs=0.01)


def test_bootstrap_is_seeded_and_contains_mean():
    rng = random.Random(0)
    data = [rng.random() for _ in range(50)]
    assert bootstrap_ci(data, seed=7) == bootstrap_ci(data, seed=7)
    lo, hi = bootstrap_ci(data)
    assert lo < sum(data) / len(data) < hi
    assert isinstance(lo, float) and isinstance(hi, float)


def test_bootstrap_rejects_bad_arguments():
    with pytest.raises(ValueError):
        bootstrap_ci([])
    with pytest.raises(ValueError):
        bootstrap_ci([1.0], alpha=0.0)
    with pytest.raises(ValueError):
        bootstrap_ci([1.0], n_boot=0)


# ---- reflection rate --------------------------------------------------------------------------------------------

def test_reflection_counts_by_hand():
    assert count_reflections("Wait, that is wrong. WAIT. wait") == 3
    # whole words only: await, waiting, waited, verified do not count
    assert count_reflections("We await the waiting list; it was verified.") == 0
    # a phrase counts once, not once per contained word
    assert count_reflections("Let me check this. Let me double-check. Let me verify.") == 3
    assert count_reflections("double check, double-check, re-examine, Re-examine") == 4
    assert count_reflections("However, alternatively, hmm... Hold on, on second thought") == 5
    assert count_reflections("The answer is 42.") == 0
    assert count_reflections("") == 0


def test_every_listed_phrase_is_counted_once():
    for phrase in REFLECTION_PHRASES:
        assert count_reflections(f"so {phrase}, fine") == 1, phrase
        assert count_reflections(f"so {phrase.upper()}.") == 1, phrase


def test_reflection_rate_per_1k_tokens():
    responses = ["Wait, let me check. However it holds.", "Direct answer: 5.", "Hmm. Verify: yes. Wait."]
    # 3 + 0 + 3 = 6 reflections over 400 tokens -> 15 per 1k tokens
    assert reflection_rate(responses, [100, 100, 200]) == pytest.approx(15.0)
    assert reflection_rate([], []) == 0.0
    assert reflection_rate(["wait"], [0]) == 0.0


def test_reflection_rate_errors():
    with pytest.raises(ValueError):
        reflection_rate(["wait"], [10, 20])
    with pytest.raises(ValueError):
        reflection_rate(["wait"], [-1])


def test_a_row_added_to_the_metric_table_reaches_every_reader(tmp_path, monkeypatch):
    """stare.eval.metrics.METRICS is the one definition: a row added there (here a per-problem "first@k", shown in
    the comparison) is computed by both harnesses and the local engine's held-out evaluation, written to summary.json
    and summary.md, printed on the CLI line and given comparison columns, with no other change."""
    import json

    from stare.cli.report.tables import write_comparison
    from stare.eval import metrics
    from stare.eval.data import Problem
    from stare.eval.lm_eval_tasks import utils
    from stare.eval.protocols import Protocol
    from stare.eval.summary import scores_line, summarise

    row = metrics.Metric("first_at_k", "first@{k}", per_problem=lambda correct, extracted, k: float(correct[0]),
                         printed=True, compare="bench")
    metrics.METRICS.append(row)
    try:
        problems = [Problem("a", "1+1?", "2"), Problem("b", "2+3?", "5")]
        results = {p.id: [{"problem_id": p.id, "sample_idx": j, "response": f"\\boxed{{{x}}}", "extracted": x,
                           "correct": x == p.answer, "num_tokens": 4} for j, x in enumerate(xs)]
                   for p, xs in zip(problems, (["2", "3"], ["4", "5"]))}
        summary = summarise(problems, results, Protocol("stare", 2, 1.0, 0.7, 16), bench="aime25", model="m",
                            backend="hf", seed=0, out=tmp_path)
        assert summary["first_at_k"] == 0.5 and summary["avg_at_k"] == 0.5 and "first_at_k" not in summary["ci95"]
        assert json.loads((tmp_path / "summary.json").read_text())["first_at_k"] == 0.5
        assert "| first@2 | 0.5000 | |" in (tmp_path / "summary.md").read_text()
        assert scores_line(summary).endswith("maj@2 0.5000  first@2 0.5000")
        assert utils.process_results({"answer": "5"}, [["\\boxed{4}", "\\boxed{5}"]])["first_at_k"] == 0.0
        local = scripted_local_eval(monkeypatch, lambda p: ["nope", p.answer], lambda p: p.answer)
        assert local["first_at_k"] == 0.0 and local["avg_at_k"] == 0.5  # the local engine's eval.json too
        write_comparison(tmp_path / "cmp", [], evals=[summary])
        md = (tmp_path / "cmp" / "comparison.md").read_text()
        assert "| aime25 avg@k | aime25 pass@k | aime25 first@k | reflection /1k tok |" in md
        assert "| 0.500 [0.500, 0.500] (k=2) | 1.000 | 0.500 | 0.00 |" in md  # the row of model m
        header = (tmp_path / "cmp" / "comparison.csv").read_text().splitlines()[0].split(",")
        i = header.index("aime25_first_at_k_mean")
        assert header[i - 2:i + 3] == ["aime25_pass_at_k_mean", "aime25_pass_at_k_std", "aime25_first_at_k_mean",
                                       "aime25_first_at_k_std", "aime25_k"]
    finally:
        metrics.METRICS.remove(row)


def scripted_local_eval(monkeypatch, samples, greedy, n_problems: int = 4):
    """The local engine's held-out evaluation (``stare.cli.local.evaluate.evaluate_policy``) on arith problems with
    scripted responses: ``samples(problem)`` -> its k sampled texts, ``greedy(problem)`` -> its greedy text."""
    import torch

    from stare.cli.local import evaluate
    from stare.cli.local.tasks import ArithTask

    task = ArithTask()
    problems = task.problems(n_problems, seed=0, split="test")
    k = len(samples(problems[0]))

    def scripted(model, tokenizer, ids, attn, *, greedy=False, repeats=1, **_):
        batch = [problems[int(i)] for i in ids[:, 0]]
        texts = [greedy_text(p) for p in batch] if greedy else [t for p in batch for t in samples(p)]
        assert greedy or repeats == k
        return type("Rollout", (), {"texts": texts})

    greedy_text = greedy
    monkeypatch.setattr(evaluate, "encode_prompts", lambda tok, prompts, chat, device: (
        torch.tensor([[i] for i in range(len(prompts))]), torch.ones(len(prompts), 1)))
    monkeypatch.setattr(evaluate, "sample", scripted)
    return evaluate.evaluate_policy(torch.nn.Linear(1, 1), None, task, n_problems=n_problems, k=k, seed=0,
                                    max_new_tokens=4, batch_prompts=n_problems)


def test_the_local_engines_held_out_numbers_by_hand(monkeypatch):
    """eval.json's avg@k, pass@k, maj@k and greedy accuracy, from scripted responses to four arith problems,
    against counts by hand. maj@k votes over the answers the task reads (the last number of the first line; a
    response without one gives no answer); a tie goes to the answer seen first."""
    from stare.cli.local.tasks import ArithTask

    problems = ArithTask().problems(4, seed=0, split="test")
    a = [p.answer for p in problems]
    assert "97" not in a and "98" not in a and "99" not in a
    script = {a[0]: [f"3 + 4 = {a[0]}", "99", a[0], " 99"],  # 2 of 4 right; a tie, the right answer first
              a[1]: ["98", "98", a[1], "no number"],  # 1 of 4; majority 98, wrong
              a[2]: ["", " ", "none", "-"],  # no answer at all: the vote is wrong
              a[3]: ["97", a[3], "", "x"]}  # 1 of 4; a tie, 97 first: wrong
    assert len(set(a)) == 4
    greedy = {a[0]: a[0], a[1]: "x", a[2]: f"{a[2]}\n1", a[3]: f"= {a[3]}."}
    out = scripted_local_eval(monkeypatch, lambda p: script[p.answer], lambda p: greedy[p.answer])
    assert out["k"] == 4 and out["n_problems"] == 4
    assert out["avg_at_k"] == pytest.approx((2 + 1 + 0 + 1) / 16)
    assert out["pass_at_k"] == pytest.approx(3 / 4)  # k of 4 samples: a problem passes when any one is right
    assert out["maj_at_k"] == pytest.approx(1 / 4)
    assert out["greedy_accuracy"] == pytest.approx(3 / 4)
    assert out["avg_at_4"] == out["avg_at_k"] and out["pass_at_4"] == out["pass_at_k"]  # the deprecated names
    two = scripted_local_eval(monkeypatch, lambda p: script[p.answer][:2], lambda p: greedy[p.answer])
    assert (two["k"], two["avg_at_k"], two["pass_at_k"], two["maj_at_k"]) == (2, 2 / 8, 2 / 4, 1 / 4)  # first two
