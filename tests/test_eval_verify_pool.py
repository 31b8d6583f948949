"""stare.eval.verify_pool (eval/verify_pool.py): the check run inside a worker (``check_in_worker``, math-verify
with its signal timeouts off), the worker count (``default_workers``), and the pool's life cycle (``checkout``,
``checkin``, ``live``, ``shutdown``) and line protocol, on workers that import a stand-in math_verify (so they start
in a blink). Scoring through the pool (timeouts, kills, threads): tests/test_scoring.py."""
import os
import select

import pytest

from stare.eval import verify_pool

FAKE_MATH_VERIFY = r'''
"""A stand-in math_verify: exact string equality after unboxing, and 1/2 read as 0.5."""
class LatexExtractionConfig:
    pass


class ExprExtractionConfig:
    pass


def parse(text, extraction_config=None, parsing_timeout=None):
    text = text.strip("$")
    if text.startswith("\\boxed{"):
        text = text[len("\\boxed{"):-1]
    return [{"\\frac{1}{2}": "0.5"}.get(text, text)] if text else []


def verify(gold, pred, timeout_seconds=None):
    return gold == pred
'''


@pytest.mark.parametrize("pred, gold, equal", [
    ("033", "33", True),  # a leading zero
    (r"\frac{1}{2}", "0.5", True),
    (r"\frac12", "0.5", True),  # read as the content of a box: bare, these three parse to nothing
    (r"\sqrt{4}", "2", True),
    (r"2^{10}", "1024", True),
    ("34", "33", False),
    ("", "33", False),  # nothing in the box
    ("33", "", False),  # no gold
    (r"\frac{", "1", False),  # unparsable: False, never an exception
])
def test_check_in_worker_hand_cases(pred, gold, equal):
    assert verify_pool.check_in_worker(pred, gold) is equal


def test_check_in_worker_scores_a_failing_checker_false(monkeypatch):
    import math_verify

    def broken(*args, **kwargs):
        raise RuntimeError("the checker broke")

    assert verify_pool.check_in_worker("1", "1") is True
    monkeypatch.setattr(math_verify, "parse", broken)
    assert verify_pool.check_in_worker("1", "1") is False


def test_default_workers_is_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert verify_pool.default_workers() == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(), raising=False)
    assert verify_pool.default_workers() == 1
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # not on Linux: the machine's CPUs
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert verify_pool.default_workers() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert verify_pool.default_workers() == 1


def answer(worker, pred, gold) -> bytes:
    """Send one check to ``worker`` and wait (10 s at most) for its line."""
    worker.send(0, pred, gold)
    for _ in range(100):
        if select.select([worker], [], [], 0.1)[0]:
            line = worker.read_line()
            if line is not None:
                return line
    raise AssertionError("the worker did not answer within 10 s")


@pytest.fixture
def stand_in_pool(tmp_path, monkeypatch):
    """Workers started from here import the stand-in math_verify (they get this process's sys.path)."""
    (tmp_path / "math_verify.py").write_text(FAKE_MATH_VERIFY)
    monkeypatch.syspath_prepend(str(tmp_path))
    verify_pool.shutdown()  # no worker that imported the real one
    yield
    verify_pool.shutdown()


def test_workers_are_checked_out_answer_lines_are_kept_when_idle_and_stopped_by_shutdown(stand_in_pool):
    workers = verify_pool.checkout(2)
    assert len(workers) == 2 and all(verify_pool.live(w) for w in workers)
    assert len({w.proc.pid for w in workers}) == 2
    first, second = workers
    assert answer(first, r"\frac{1}{2}", "0.5") == b"true\n"
    assert answer(first, "34", "33") == b"false\n"
    first.answer = None  # answered (the scorer clears it when it reads the line)
    assert second.answer is None
    second.send(1, "1", "1")  # still holding an answer: not reusable
    verify_pool.checkin(workers)
    assert verify_pool.live(first) and not verify_pool.live(second)
    again = verify_pool.checkout(1)
    assert again == [first]  # the idle worker, no new process
    verify_pool.checkin(again)
    verify_pool.shutdown()
    assert not verify_pool.live(first)
    assert first.proc.wait(timeout=10) is not None
