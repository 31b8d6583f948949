"""stare.eval.scoring: boxed-answer extraction and math-verify scoring in a worker-process pool."""
import threading
import time

import pytest

from stare.eval import verify_pool
from stare.eval.scoring import is_correct, score_many, shutdown

# A power tower: sympy tries to evaluate 9**(9**(9**9)) and never returns in any useful time.
HANGS = r"The answer is $\boxed{9^{9^{9^{9}}}}$."


@pytest.fixture(scope="module", autouse=True)
def _close_pool():
    yield
    shutdown()


# (response, gold, expected)
CASES = [
    (r"So the answer is $\boxed{033}$.", "33", True),  # leading zero in the answer
    (r"\boxed{33}", "033", True),  # leading zero in the gold
    (r"\boxed{\frac12}", "0.5", True),  # fraction vs decimal
    (r"\boxed{0.5}", r"\frac{1}{2}", True),
    (r"\boxed{\dfrac{3}{4}}", "0.75", True),  # \dfrac
    (r"\boxed{1,000}", "1000", True),  # thousands separator
    (r"\boxed{1{,}000}", "1000", True),
    (r"\boxed{30^\circ}", "30", True),  # degrees
    (r"\boxed{30^{\circ}}", r"30^\circ", True),
    (r"\boxed{\text{30}}", "30", True),  # \text{} wrapper
    (r"\boxed{5\text{ cm}}", "5", True),  # unit text
    (r"\boxed{\text{(B)}}", "B", True),  # multiple-choice letter
    (r"\boxed{-7}", "-7", True),  # negative
    (r"\boxed{7}", "-7", False),  # sign dropped
    (r"\boxed{(1,2]}", "(1,2]", True),  # interval
    (r"\boxed{[1,2]}", "(1,2]", False),  # wrong endpoint
    (r"\boxed{\{3,1,2\}}", r"\{1,2,3\}", True),  # set, any order
    (r"\boxed{2,5}", "2.5", False),  # a list is not a decimal comma
    (r"\boxed{34}", "33", False),  # close but wrong
    (r"\boxed{0.333}", r"\frac13", False),  # rounded too early
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", True),  # nested braces
    (r"\boxed{x=5}", "5", True),  # assignment
    ("The answer is 33.", "33", False),  # no boxed answer
    (r"First \boxed{12}, no wait: \boxed{33}", "33", True),  # the last box counts
    (r"First \boxed{33}, no wait: \boxed{12}", "33", False),
    (r"\boxed{12} and then truncated \boxed{33", "33", False),  # unclosed box ignored
    (r"\fbox{33}", "33", True),  # \fbox
    (r"\boxed 33", "33", True),  # \boxed without braces
    (r"\boxed{33}", r"\boxed{33}", True),  # boxed gold
    (r"\boxed{33}", "$33$", True),  # gold in $...$
    (r"\boxed{}", "33", False),  # empty box
    (r"\boxed{33}", "", False),  # empty gold
]


@pytest.mark.parametrize("response,gold,expected", CASES)
def test_is_correct_table(response, gold, expected):
    assert is_correct(response, gold) is expected


def test_score_many_matches_table_and_keeps_order():
    pairs = [(r, g) for r, g, _ in CASES] * 3
    expected = [e for _, _, e in CASES] * 3
    assert score_many(pairs, workers=2) == expected


def test_never_raises_on_bad_input():
    assert is_correct(None, "1") is False
    assert is_correct(r"\boxed{1}", None) is False
    assert is_correct(r"\boxed{\frac{", "1") is False
    assert is_correct(r"\boxed{1}", 1) is True  # a Python number as gold is read as its string
    assert score_many([]) == []
    assert score_many([("bad",), (r"\boxed{2}", "2")]) == [False, True]


def test_pathological_answer_times_out_and_pool_recovers():
    start = time.monotonic()
    assert is_correct(HANGS, "1", timeout=2.0) is False
    assert time.monotonic() - start < 2.0 + 5.0
    assert is_correct(r"\boxed{\frac12}", "0.5") is True  # the pool answers right afterwards


def test_pathological_answer_in_a_batch_costs_only_itself():
    good = [(rf"\boxed{{{i}}}", str(i)) for i in range(20)]
    pairs = good[:5] + [(HANGS, "1")] + good[5:]
    start = time.monotonic()
    assert score_many(pairs, timeout=2.0, workers=2) == [True] * 5 + [False] + [True] * 15
    assert time.monotonic() - start < 2.0 + 5.0


def test_called_from_threads():
    results = {}

    def check(k):
        results[k] = is_correct(rf"\boxed{{{k}^\circ}}", str(k))

    threads = [threading.Thread(target=check, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {k: True for k in range(6)}


def test_timeout_from_a_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(is_correct(HANGS, "1", timeout=1.0)))
    t.start()
    t.join(timeout=30)
    assert out == [False]
    assert is_correct(r"\boxed{1{,}000}", "1000") is True


def test_pool_killed_under_a_batch_reruns_its_answers(caplog):
    caplog.set_level("DEBUG", logger="stare.eval.scoring")
    # distinct: no parse cache hits
    pairs = [(rf"\boxed{{{i}/7}}", rf"\frac{{{i}}}{{7}}") for i in range(3000)]
    out = []
    worker = threading.Thread(target=lambda: out.append(score_many(pairs, workers=2)))
    worker.start()
    for _ in range(2):  # kill the pool under the batch twice (what another answer's timeout does)
        # once a worker holds an answer: a fixed sleep could land before the workers had started (a slow start),
        # or after the batch had ended, and then nothing was re-run
        deadline = time.monotonic() + 120
        while worker.is_alive() and not any(w.answer is not None for w in list(verify_pool._all)):
            assert time.monotonic() < deadline, "no scoring worker took an answer within 120 s"
            time.sleep(0.01)
        shutdown()
    worker.join(timeout=300)  # generous: a loaded CI machine once took over 60 s
    assert not worker.is_alive(), "score_many did not finish within 300 s"
    assert out == [[True] * len(pairs)]
    assert any("re-running answer" in r.getMessage() for r in caplog.records)


# ---- callers without an importable __main__, and a checker that cannot run ---------------------------------------

SCRIPT = """
import sys
sys.path[:0] = {path!r}
import threading
from stare.eval import is_correct, score_many
out = []
t = threading.Thread(target=lambda: out.append(is_correct(r"\\\\boxed{{30^\\\\circ}}", "30")))
t.start()
print(is_correct(r"\\\\boxed{{\\\\frac12}}", "0.5"), score_many([(r"\\\\boxed{{033}}", "33"), (r"\\\\boxed{{7}}", "-7")]))
t.join()
print(out)
"""


@pytest.mark.parametrize("how", ["stdin", "-c"])
def test_scoring_works_from_python_stdin_and_python_c(how, tmp_path):
    """``python - <<EOF`` (``__main__`` is ``<stdin>``, which spawned workers cannot re-import) and ``python -c``,
    each also from a thread."""
    import subprocess
    import sys

    script = SCRIPT.format(path=sys.path)
    argv, stdin = ([sys.executable, "-"], script) if how == "stdin" else ([sys.executable, "-c", script], None)
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-2:] == ["True [True, False]", "[True]"], proc.stderr
    assert "scoring failed" not in proc.stderr


def test_a_checker_that_cannot_start_raises_instead_of_scoring_zero(tmp_path, monkeypatch):
    from stare.eval.scoring import ScoringError

    (tmp_path / "math_verify.py").write_text("raise ImportError('math_verify is broken in this environment')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers get this process's sys.path
    shutdown()  # no worker that already imported the real one
    try:
        with pytest.raises(ScoringError, match="could not start.*math_verify is broken in this environment"):
            score_many([(r"\boxed{1}", "1"), (r"\boxed{2}", "3")])
        with pytest.raises(ScoringError):
            is_correct(r"\boxed{1}", "1")
    finally:
        monkeypatch.undo()
        shutdown()
    assert is_correct(r"\boxed{1}", "1") is True  # a working checker again once the environment is fixed


def test_check_many_says_why_an_answer_scored_false():
    from stare.eval.scoring import check_many

    pairs = [(r"\boxed{33}", "33"), (r"\boxed{34}", "33"), ("no box", "33"), (r"\boxed{1}", ""), (HANGS, "1")]
    assert check_many(pairs, timeout=2.0, workers=2) == ["correct", "wrong", "no_answer", "no_answer", "timeout"]


def test_an_evaluation_of_only_empty_responses_says_so_in_one_line(tmp_path, caplog):
    from stare.eval.data import Problem
    from stare.eval.harness import run_eval
    from stare.eval.protocols import Protocol
    from stare.eval.scoring import warn_if_all_empty

    class Silent:  # a model that emits EOS at once
        name = "silent"

        def prompt_text(self, problem, instruction):
            return problem

        def generate(self, prompt, n, proto, seed):
            return [("", 0)] * n

    problems = [Problem("a", "qa", "12"), Problem("b", "qb", "7")]
    caplog.set_level("WARNING")
    s = run_eval(problems, Silent(), Protocol("stare", 3, 1.0, 0.7, 16), tmp_path, bench="aime24", model="m",
                 seed=0, resume=False)
    warned = [r.getMessage() for r in caplog.records if "responses are empty" in r.getMessage()]
    assert s["avg_at_k"] == 0 and len(warned) == 1 and "\n" not in warned[0]
    assert warned[0].startswith("all 6 responses are empty")
    assert warn_if_all_empty(["", " \n", None]) is not None
    assert warn_if_all_empty(["", "x"]) is None and warn_if_all_empty([]) is None
