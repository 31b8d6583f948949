"""Answer scoring: is a model's last ``\\boxed{}`` answer equal to the gold answer?

Three layers, top to bottom:

1. ``extract_boxed`` pulls the last boxed answer out of a response (plain string work, in this process).
2. ``_check_in_worker`` asks math-verify whether that answer equals the gold answer. It runs in a worker
   *process*: math-verify's own timeouts use ``signal.alarm``, which only works on a main thread, so they
   are switched off (``parsing_timeout=None``, ``timeout_seconds=None``) and the time limit is enforced here.
3. ``check_many`` / ``score_many`` / ``is_correct`` hand checks to shared worker processes and wait at most
   ``timeout`` seconds per answer, counted from when the answer reaches a worker. An answer over its limit
   scores False and only its worker is killed (a fresh one replaces it), so a hung sympy computation cannot
   block the harness; an answer whose worker died under it (``shutdown()`` from another thread) is re-run.

The workers are plain ``python -c`` processes started from ``sys.executable`` with this process's ``sys.path``;
they import this module by name (math-verify preloaded), never the caller's ``__main__``. So scoring works the
same from a script, ``python -``, ``python -c``, a notebook or a thread, with no ``__main__`` guard needed
(``multiprocessing``'s spawn re-imports ``__main__``, so its workers die under ``python -``).

Bad input never raises: it scores False. A checker that cannot run (workers that do not start, or die on the
same answer again and again) raises ``ScoringError``: it never turns into wrong answers.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

__all__ = ["extract_boxed", "is_correct", "score_many", "check_many", "shutdown", "ScoringError", "VERDICTS",
           "warn_if_all_empty"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often the waiting loop checks deadlines
_MAX_TRIES = 3  # an answer whose worker died under it (another answer's timeout) is re-run this often
_POOL_START_TIMEOUT_S = 120.0  # spawning + importing sympy/math-verify in the workers


# --------------------------------------------------------------------------------------------------
# 1. Extraction
# --------------------------------------------------------------------------------------------------

BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")  # where a box starts (also the tool loop's test)


def _match_braces(text: str, open_at: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_at``, or None when unbalanced. ``\\{``/``\\}`` are skipped."""
    depth = 0
    i = open_at
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # escaped character (\{, \}, \\): never a grouping brace
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed 42`` in ``text``, else None.

    Braces are matched with nesting (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``); a box nested inside
    another box belongs to the outer one; an unclosed (truncated) box is ignored.
    """
    if not isinstance(text, str):
        return None
    last = None
    pos = 0
    while (m := BOX_COMMAND.search(text, pos)) is not None:
        start = m.end()
        after = start
        while after < len(text) and text[after].isspace():
            after += 1
        if after < len(text) and text[after] == "{":
            close = _match_braces(text, after)
            if close is None:  # truncated box: skip the command, keep looking
                pos = start
                continue
            last = text[after + 1 : close].strip()
            pos = close + 1
        elif after > start:  # "\boxed 42": the answer is the next token
            token = re.match(r"[^\s$]+", text[after:])
            if token is not None:
                last = token.group(0).rstrip(".,;")
            pos = after
        else:
            pos = start
    return last


def _gold_latex(gold) -> str | None:
    """Gold answer as bare LaTeX: boxed content if boxed, ``$...$`` stripped, numbers as their string."""
    if isinstance(gold, (int, float)) and not isinstance(gold, bool):
        gold = str(gold)
    if not isinstance(gold, str):
        return None
    gold = extract_boxed(gold) or gold
    gold = gold.strip().strip("$").strip()
    return gold or None


# --------------------------------------------------------------------------------------------------
# 2. The check itself (runs inside a worker process)
# --------------------------------------------------------------------------------------------------


def _init_worker() -> None:
    """Worker start-up: ignore Ctrl-C (the parent handles it), import math-verify, warm its caches."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # math-verify warns once that its own timeout is disabled; that is deliberate here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401 - an import error ends the worker with its message (a ScoringError upstairs)

    if not (_check_in_worker("1", "1") and _check_in_worker(r"\frac{1}{2}", "0.5")):
        raise SystemExit("math-verify does not work here: it says 1 != 1 or 1/2 != 0.5")


def _check_in_worker(pred_latex: str, gold_latex: str) -> bool:
    """math-verify: does boxed ``pred_latex`` equal ``gold_latex``? No signal-based timeouts; never raises."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

        config = [LatexExtractionConfig(), ExprExtractionConfig()]  # Expr: bare numbers like "033"
        gold = parse(f"${gold_latex}$", extraction_config=config, parsing_timeout=None)
        pred = parse(f"\\boxed{{{pred_latex}}}", extraction_config=config, parsing_timeout=None)
        if not gold or not pred:
            return False
        return bool(verify(gold, pred, timeout_seconds=None))  # gold first
    except Exception:  # noqa: BLE001 - any failure scores False
        return False


class ScoringError(RuntimeError):
    """The checker itself could not run (no answer was scored wrong because of it)."""


def _serve() -> None:
    """A worker's main loop: one JSON request per stdin line (``[pred_latex, gold_latex]``), one ``true``/``false``
    line back. Ends when stdin closes (the caller went away)."""
    out, sys.stdout = sys.stdout, sys.stderr  # stdout carries only the protocol: stray prints go to the log
    _init_worker()
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        pred_latex, gold_latex = json.loads(line)
        out.write("true\n" if _check_in_worker(pred_latex, gold_latex) else "false\n")
        out.flush()


# --------------------------------------------------------------------------------------------------
# 3. The shared workers
# --------------------------------------------------------------------------------------------------

_BOOT = ("import importlib, json, sys; sys.path[:] = json.loads(sys.stdin.readline()); "
         "importlib.import_module(sys.argv[1])._serve()")


class _Worker:
    """One checker process. Used by one thread at a time (checked out of ``_idle``)."""

    def __init__(self):
        self.log = tempfile.TemporaryFile()  # its stderr (math-verify may warn a lot: a pipe could fill up)
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, __name__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, close_fds=True)
        self.proc.stdin.write((json.dumps([str(p) for p in sys.path]) + "\n").encode())
        self.proc.stdin.flush()
        self.buf = b""
        self.ready = False
        self.started_at: float | None = None  # when its current answer was handed over
        self.answer: int | None = None

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def read_line(self) -> bytes | None:
        """A complete line when one is there (after ``select`` said readable), b"" at end of file, else None."""
        chunk = os.read(self.fileno(), 4096)
        if not chunk:
            return b""
        self.buf += chunk
        if b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            return line + b"\n"
        return None

    def send(self, answer: int, pred_latex: str, gold_latex: str) -> None:
        self.proc.stdin.write((json.dumps([pred_latex, gold_latex]) + "\n").encode())
        self.proc.stdin.flush()
        self.answer, self.started_at = answer, time.monotonic()

    def stderr_tail(self) -> str:
        try:
            self.log.seek(0)
            lines = self.log.read().decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            return ""
        return lines[-1] if lines else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """Kill the process, leave the pipes to the thread using it (it sees end of file and re-runs its answer)."""
        with _lock:
            _all.discard(self)
        try:
            self.proc.kill()
        except OSError:
            pass

    def kill(self) -> None:
        """Kill and clean up; only by the thread that holds the worker (or for an idle one)."""
        self.stop()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout, self.log):
            try:
                f.close()
            except OSError:
                pass


_lock = threading.Lock()
_idle: list[_Worker] = []  # started and ready, not in use
_all: set[_Worker] = set()  # every live worker (shutdown() kills them, in use or not)


def _default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _checkout(n: int) -> list[_Worker]:
    """Up to ``n`` workers for one batch: idle ones first, the rest started now (all of them together). While other
    threads hold workers, a batch gets no more than what keeps the total near ``max(n, CPUs)``, and at least one."""
    with _lock:
        busy = len(_all) - len(_idle)
        n = max(1, min(n, max(n, _default_workers()) - busy))
        taken = _idle[:n]
        del _idle[:n]
    mine = [w for w in taken if w.alive()]
    for w in taken:
        if w not in mine:
            w.kill()
    fresh: list[_Worker] = []
    try:
        for _ in range(_MAX_TRIES):  # shutdown() from another thread may kill workers while they start
            while len(mine) + len(fresh) < n:
                fresh.append(_start())
            fresh = _wait_ready(fresh)
            if len(mine) + len(fresh) == n:
                return mine + fresh
        raise ScoringError("the scoring workers were stopped while they started, again and again")
    except BaseException:
        for w in fresh + mine:
            w.kill()
        raise


def _start() -> _Worker:
    try:
        w = _Worker()
    except OSError as exc:  # no interpreter to run (an embedded Python), or out of processes
        raise ScoringError(f"cannot start a scoring worker with {sys.executable!r}: {exc}") from None
    with _lock:
        _all.add(w)
    return w


def _wait_ready(workers: list[_Worker]) -> list[_Worker]:
    """The workers that said ``ready`` (math-verify imported), less those ``shutdown()`` stopped meanwhile; raise
    ScoringError when one fails to start by itself."""
    deadline = time.monotonic() + _POOL_START_TIMEOUT_S
    waiting, ready = list(workers), []
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ScoringError(f"the scoring workers did not start within {_POOL_START_TIMEOUT_S:.0f} s")
        readable, _, _ = select.select(waiting, [], [], min(left, 1.0))
        for w in readable:
            line = w.read_line()
            if line is None:
                continue
            waiting.remove(w)
            if line == b"ready\n":
                ready.append(w)
            elif w not in _all:  # stopped by shutdown(): the caller starts another
                w.kill()
            else:  # died by itself, or printed something else
                try:
                    w.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
                why = w.stderr_tail() or f"exit status {w.proc.returncode}"
                raise ScoringError(f"a scoring worker ({sys.executable} -c ..., importing {__name__} and "
                                   f"math-verify) could not start: {why}")
    return ready


def _checkin(workers: list[_Worker]) -> None:
    keep = [w for w in workers if w.alive() and w.answer is None and w in _all]
    with _lock:
        _idle.extend(keep)
    for w in workers:
        if w not in keep:
            w.kill()


def shutdown() -> None:
    """Stop every worker now (also run at exit). Checks in flight on them are re-run on fresh workers."""
    with _lock:
        idle, busy = list(_idle), [w for w in _all if w not in _idle]
        _idle.clear()
    for w in idle:
        w.kill()
    for w in busy:  # their threads clean up
        w.stop()


atexit.register(shutdown)


# --------------------------------------------------------------------------------------------------
# 4. Public scoring API
# --------------------------------------------------------------------------------------------------

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
            pred_latex, gold_latex = extract_boxed(response), _gold_latex(gold)
        except Exception:  # noqa: BLE001 - malformed pair
            continue
        if pred_latex and gold_latex:
            todo[i] = (pred_latex, gold_latex)
    if not todo:
        return verdicts

    pending = deque(todo)
    tries = dict.fromkeys(todo, 0)
    crew = _checkout(min(len(todo), max(1, workers or _default_workers())))
    size = len(crew)
    try:
        while pending or any(w.answer is not None for w in crew):
            for w in list(crew):
                if w not in _all or not w.alive():  # killed by shutdown() (or crashed)
                    crew.remove(w)
                    if w.answer is not None:
                        i, w.answer = w.answer, None
                        _rerun(i, tries, pending, w)
                    w.kill()
            if pending and len(crew) < size:  # fresh workers for what is left
                crew += _checkout(min(size - len(crew), len(pending)))
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
        _checkin(crew)
    return verdicts


def _rerun(i: int, tries: dict, pending: deque, w: _Worker) -> None:
    if tries[i] >= _MAX_TRIES:
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
