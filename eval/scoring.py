"""Answer scoring: is a model's last ``\\boxed{}`` answer equal to the gold answer?

Three layers, top to bottom:

1. ``stare.eval.extraction.extract_boxed`` pulls the last boxed answer out of a response (in this process).
2. math-verify decides whether that answer equals the gold answer, in a worker *process* of
   ``stare.eval.verify_pool`` (math-verify's signal-based timeouts cannot run on a thread).
3. ``check_many`` / ``score_many`` / ``is_correct`` (here) hand checks to the shared workers and wait at most
   ``timeout`` seconds per answer, counted from when the answer reaches a worker. An answer over its limit
   scores False and only its worker is killed (a fresh one replaces it), so a hung sympy computation cannot
   block the harness; an answer whose worker died under it (``shutdown()`` from another thread) is re-run.

Bad input never raises: it scores False. A checker that cannot run (workers that do not start, or die on the
same answer again and again) raises ``ScoringError``: it never turns into wrong answers. ``ScoringError`` and
``shutdown`` (stop every worker now) are the pool's, and part of this module's interface.
"""
from __future__ import annotations

import logging
import select
import time
from collections import deque

from .extraction import extract_boxed, gold_latex
from .verify_pool import MAX_TRIES, ScoringError, Worker, checkin, checkout, default_workers, live, shutdown

__all__ = ["is_correct", "score_many", "check_many", "shutdown", "ScoringError", "VERDICTS", "warn_if_all_empty"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often the waiting loop checks deadlines


VERDICTS = ("correct", "wrong", "no_answer", "timeout")  # what check_many says about each answer


def check_many(pairs: list[tuple[str, str]], *, timeout: float = 5.0, workers: int | None = None) -> list[str]:
    """One verdict per ``(response, gold)`` pair, order preserved: ``correct``, ``wrong``, ``no_answer`` (no boxed
    answer, an empty or missing gold, a malformed pair) or ``timeout`` (the check ran past ``timeout`` seconds,
    counted from when it reached a worker). ``workers``: at most this many checks at once (default: one per CPU).

    Raises ``ScoringError`` when the checker cannot run (workers that do not start, or an answer whose worker
    died under it more than a few times): such answers are never reported as wrong.
    """
    pairs = list(pairs)
    verdicts = ["no_answer"] * len(pairs)
    todo: dict[int, tuple[str, str]] = {}  # answers that need math-verify, by position
    for i, pair in enumerate(pairs):
        try:
            response, gold = pair
            pred, gold_text = extract_boxed(response), gold_latex(gold)
        except Exception:  # noqa: BLE001 - malformed pair
            continue
        if pred and gold_text:
            todo[i] = (pred, gold_text)
    if not todo:
        return verdicts

    pending = deque(todo)
    tries = dict.fromkeys(todo, 0)
    crew = checkout(min(len(todo), max(1, workers or default_workers())))
    size = len(crew)
    try:
        while pending or any(w.answer is not None for w in crew):
            for w in list(crew):
                if not live(w):  # killed by shutdown() (or crashed)
                    crew.remove(w)
                    if w.answer is not None:
                        i, w.answer = w.answer, None
                        _rerun(i, tries, pending, w)
                    w.kill()
            if pending and len(crew) < size:  # fresh workers for what is left
                crew += checkout(min(size - len(crew), len(pending)))
            for w in crew:
                if w.answer is None and pending:
                    i = pending.popleft()
                    tries[i] += 1
                    try:
                        w.send(i, *todo[i])
                    except OSError:  # its pipe broke: it died just now; the loop above replaces it
                        w.answer = i
            busy = [w for w in crew if w.answer is not None]
            readable, _, _ = select.select(busy, [], [], _POLL_S)
            for w in readable:
                line = w.read_line()
                if line is None:
                    continue
                i, w.answer, w.started_at = w.answer, None, None
                if line in (b"true\n", b"false\n"):
                    verdicts[i] = "correct" if line == b"true\n" else "wrong"
                else:  # end of file: it died under this answer
                    w.answer = None
                    _rerun(i, tries, pending, w)
                    w.kill()
            now = time.monotonic()
            for w in crew:
                if w.answer is not None and w.started_at is not None and now - w.started_at > timeout and \
                        not select.select([w], [], [], 0)[0]:  # its verdict is not waiting to be read
                    logger.warning("answer %r timed out after %.1fs; scoring it False", todo[w.answer][0][:80], timeout)
                    verdicts[w.answer] = "timeout"
                    w.answer = None
                    w.kill()  # only this worker; the loop starts a fresh one when there is more to do
    finally:
        for w in crew:
            if w.answer is not None:  # interrupted: leave nothing running
                w.kill()
        checkin(crew)
    return verdicts


def _rerun(i: int, tries: dict, pending: deque, w: Worker) -> None:
    if tries[i] >= MAX_TRIES:
        raise ScoringError(f"the scoring worker died {tries[i]} times on the same answer "
                           f"({w.stderr_tail() or 'no message'})")
    logger.debug("re-running answer %d after its worker died (try %d)", i, tries[i])
    pending.appendleft(i)


def score_many(pairs: list[tuple[str, str]], *, timeout: float = 5.0, workers: int | None = None) -> list[bool]:
    """``[is_correct(response, gold) for response, gold in pairs]``, checked in parallel, order preserved.

    ``timeout``: seconds per answer, from when it reaches a worker (past it: False). ``workers``: at most this
    many of the batch's answers in flight at once (default: one per CPU). Raises ``ScoringError`` when the
    checker cannot run (see ``check_many``): a broken checker never becomes a score of 0.
    """
    return [v == "correct" for v in check_many(pairs, timeout=timeout, workers=workers)]


def is_correct(response: str, gold: str, *, timeout: float = 5.0) -> bool:
    """Does the last ``\\boxed{}`` answer in ``response`` equal ``gold`` (math-verify)?

    ``gold`` is a string such as ``"33"``, ``"\\frac{1}{2}"``, ``"$(1,2]$"`` or ``"\\boxed{30^\\circ}"``.
    No boxed answer, a wrong answer, a parse failure or a check longer than ``timeout`` seconds: False.
    Raises ``ScoringError`` only when the checker itself cannot run.
    """
    return score_many([(response, gold)], timeout=timeout, workers=1)[0]


def warn_if_all_empty(responses, *, log: logging.Logger | None = None) -> str | None:
    """One warning line when every response is empty or blank (a model that ends each answer at once, e.g. it
    emits EOS first): its 0 then means "nothing was generated", not wrong answers. Returns the line (None when
    at least one response has text, or there are none)."""
    texts = [r if isinstance(r, str) else "" for r in responses]
    if not texts or any(t.strip() for t in texts):
        return None
    line = (f"all {len(texts)} responses are empty: the model ended every answer at once (e.g. it emits EOS "
            f"first), so every score is 0 for want of an answer; check the model, its chat template and stop tokens")
    (log or logging.getLogger("stare.eval")).warning(line)
    return line
