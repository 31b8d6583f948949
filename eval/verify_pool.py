"""math-verify in shared worker processes: the check itself (``check_in_worker``, run inside a worker) and the
pool of workers the calling process checks out and in (``checkout``, ``checkin``, ``shutdown``).

math-verify's own timeouts use ``signal.alarm``, which only works on a main thread, so in a worker they are
switched off (``parsing_timeout=None``, ``timeout_seconds=None``); the caller (``stare.eval.scoring``) enforces
the time limit and kills only the worker of an answer over it.

The workers are plain ``python -c`` processes started from ``sys.executable`` with this process's ``sys.path``;
they import this module by name (math-verify preloaded), never the caller's ``__main__``. So scoring works the
same from a script, ``python -``, ``python -c``, a notebook or a thread, with no ``__main__`` guard needed
(``multiprocessing``'s spawn re-imports ``__main__``, so its workers die under ``python -``). A worker that cannot
start raises ``ScoringError``. This module imports the standard library only, so a worker starts fast.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
import time

MAX_TRIES = 3  # an answer whose worker died under it (another answer's timeout) is re-run this often
POOL_START_TIMEOUT_S = 120.0  # spawning + importing sympy/math-verify in the workers


# The check itself, inside a worker process

def _init_worker() -> None:
    """Worker start-up: ignore Ctrl-C (the parent handles it), import math-verify, warm its caches."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # math-verify warns once that its own timeout is disabled; that is deliberate here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401 - an import error ends the worker with its message (a ScoringError upstairs)

    if not (check_in_worker("1", "1") and check_in_worker(r"\frac{1}{2}", "0.5")):
        raise SystemExit("math-verify does not work here: it says 1 != 1 or 1/2 != 0.5")


def check_in_worker(pred_latex: str, gold_latex: str) -> bool:
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
        out.write("true\n" if check_in_worker(pred_latex, gold_latex) else "false\n")
        out.flush()


# The shared workers, in the calling process

_BOOT = ("import importlib, json, sys; sys.path[:] = json.loads(sys.stdin.readline()); "
         "importlib.import_module(sys.argv[1])._serve()")


class Worker:
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
_idle: list[Worker] = []  # started and ready, not in use
_all: set[Worker] = set()  # every live worker (shutdown() kills them, in use or not)


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def checkout(n: int) -> list[Worker]:
    """Up to ``n`` workers for one batch: idle ones first, the rest started now (all of them together). While other
    threads hold workers, a batch gets no more than what keeps the total near ``max(n, CPUs)``, and at least one."""
    with _lock:
        busy = len(_all) - len(_idle)
        n = max(1, min(n, max(n, default_workers()) - busy))
        taken = _idle[:n]
        del _idle[:n]
    mine = [w for w in taken if w.alive()]
    for w in taken:
        if w not in mine:
            w.kill()
    fresh: list[Worker] = []
    try:
        for _ in range(MAX_TRIES):  # shutdown() from another thread may kill workers while they start
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


def _start() -> Worker:
    try:
        w = Worker()
    except OSError as exc:  # no interpreter to run (an embedded Python), or out of processes
        raise ScoringError(f"cannot start a scoring worker with {sys.executable!r}: {exc}") from None
    with _lock:
        _all.add(w)
    return w


def _wait_ready(workers: list[Worker]) -> list[Worker]:
    """The workers that said ``ready`` (math-verify imported), less those ``shutdown()`` stopped meanwhile; raise
    ScoringError when one fails to start by itself."""
    deadline = time.monotonic() + POOL_START_TIMEOUT_S
    waiting, ready = list(workers), []
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ScoringError(f"the scoring workers did not start within {POOL_START_TIMEOUT_S:.0f} s")
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


def live(w: Worker) -> bool:
    """Whether ``w`` is still a worker of the pool (``shutdown()`` has not stopped it) and its process runs."""
    return w in _all and w.alive()


def checkin(workers: list[Worker]) -> None:
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
