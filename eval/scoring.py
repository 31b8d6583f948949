"""Answer scoring: is a model's last ``\\boxed{}`` answer equal to the gold answer?

Three layers, top to bottom:

1. ``extract_boxed`` pulls the last boxed answer out of a response (plain string work, in this process).
2. ``_check_in_worker`` asks math-verify whether that answer equals the gold answer. It runs in a worker
   *process*: math-verify's own timeouts use ``signal.alarm``, which only works on a main thread, so they
   are switched off (``parsing_timeout=None``, ``timeout_seconds=None``) and the time limit is enforced here.
3. ``score_many`` / ``is_correct`` send checks to a shared ``ProcessPoolExecutor`` (``spawn`` context) and
   wait at most ``timeout`` seconds per answer, counted from when the answer is handed to a worker. An
   answer over its limit scores False and the pool is killed and lazily rebuilt, so a hung sympy
   computation cannot block the harness; other answers that were in flight on the killed pool are re-run
   on the fresh pool (they cost a re-run, not a wrong score).

Nothing here raises on bad input: every failure scores False. Safe to call from any thread.
Like any ``spawn``-based code, a script calling this at import time needs an ``if __name__ == "__main__":`` guard.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import re
import threading
import time
import weakref
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

__all__ = ["extract_boxed", "is_correct", "score_many", "shutdown"]

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
    _check_in_worker("1", "1")


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


def _ping() -> int:
    return os.getpid()


# --------------------------------------------------------------------------------------------------
# 3. The shared worker pool
# --------------------------------------------------------------------------------------------------

_pool: ProcessPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()
_killed_pools: weakref.WeakSet = weakref.WeakSet()  # a future on one of these may never finish


def _default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _get_pool(min_workers: int) -> ProcessPoolExecutor:
    """The shared pool, created (and warmed up: all workers started) on first use or after a kill."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is not None and _pool_size < min_workers:
            _pool.shutdown(wait=False)  # too small: let its running checks finish, start a bigger one
            _pool = None
        if _pool is None:
            size = max(min_workers, _default_workers())
            pool = ProcessPoolExecutor(
                max_workers=size, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker
            )
            try:  # start every worker now, so no answer's time limit pays for the start-up
                for fut in [pool.submit(_ping) for _ in range(size)]:
                    fut.result(timeout=_POOL_START_TIMEOUT_S)
            except BaseException:
                _kill(pool)
                raise
            _pool, _pool_size = pool, size
        return _pool


def _kill(pool: ProcessPoolExecutor) -> None:
    """Kill a pool's worker processes at once; its unfinished futures fail (BrokenProcessPool) or are abandoned."""
    _killed_pools.add(pool)
    processes = list((getattr(pool, "_processes", None) or {}).values())  # no public API for this
    for process in processes:
        try:
            process.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
    pool.shutdown(wait=False, cancel_futures=True)


def _discard_pool(pool: ProcessPoolExecutor) -> None:
    """Kill ``pool``; the next call builds a fresh one (unless another thread already replaced it)."""
    global _pool
    with _pool_lock:
        if _pool is pool:
            _pool = None
    _kill(pool)


def shutdown() -> None:
    """Close the shared pool now (also run at exit). Checks still in flight elsewhere are re-run on a new pool."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        _kill(pool)


atexit.register(shutdown)


# --------------------------------------------------------------------------------------------------
# 4. Public scoring API
# --------------------------------------------------------------------------------------------------


def score_many(pairs: list[tuple[str, str]], *, timeout: float = 5.0, workers: int | None = None) -> list[bool]:
    """``[is_correct(response, gold) for response, gold in pairs]``, checked in parallel, order preserved.

    ``timeout``: seconds per answer, from when it reaches a worker. ``workers``: at most this many of the
    batch's answers in flight at once (default: one per CPU; the shared pool grows if asked for more).
    """
    pairs = list(pairs)
    results = [False] * len(pairs)
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
        return results

    limit = max(1, workers or _default_workers())
    pending = deque(todo)
    tries = dict.fromkeys(todo, 0)
    in_flight: dict = {}  # future -> [position, pool, started_at or None]

    def _retry(i: int, why: str) -> None:
        logger.debug("re-running answer %d after %s (try %d)", i, why, tries[i])
        if tries[i] < _MAX_TRIES:
            pending.appendleft(i)

    try:
        while pending or in_flight:
            if pending and len(in_flight) < limit:
                pool = _get_pool(limit)
                while pending and len(in_flight) < limit:
                    try:
                        fut = pool.submit(_check_in_worker, *todo[pending[0]])
                    except RuntimeError:  # another thread killed the pool just now: get a fresh one
                        break
                    i = pending.popleft()
                    tries[i] += 1
                    in_flight[fut] = [i, pool, None]

            done, _ = wait(in_flight, timeout=_POLL_S, return_when=FIRST_COMPLETED)
            for fut in done:
                i, _, _ = in_flight.pop(fut)
                try:
                    results[i] = fut.result()  # the check itself never raises ...
                except BaseException as exc:  # ... so this is a dead or cancelled pool: run the answer again
                    _retry(i, type(exc).__name__)

            now = time.monotonic()
            for fut, entry in list(in_flight.items()):
                if entry[1] in _killed_pools:  # its pool was killed (by any thread) before it finished
                    del in_flight[fut]
                    _retry(entry[0], "killed pool")
                elif entry[2] is None:
                    if fut.running():  # handed to a worker: its clock starts now
                        entry[2] = now
                elif now - entry[2] > timeout:
                    logger.warning("answer %r timed out after %.1fs; scoring it False", todo[entry[0]][0][:80], timeout)
                    del in_flight[fut]  # stays False
                    _discard_pool(entry[1])  # the others on that pool fail and are re-run above
    except Exception:  # noqa: BLE001 - e.g. the pool cannot start: whatever is unscored stays False
        logger.exception("scoring failed; unscored answers count as wrong")
    finally:
        for pool in {entry[1] for entry in in_flight.values()}:  # interrupted: leave nothing running
            _discard_pool(pool)
    return results


def is_correct(response: str, gold: str, *, timeout: float = 5.0) -> bool:
    """Does the last ``\\boxed{}`` answer in ``response`` equal ``gold`` (math-verify)? Never raises.

    ``gold`` is a string such as ``"33"``, ``"\\frac{1}{2}"``, ``"$(1,2]$"`` or ``"\\boxed{30^\\circ}"``.
    No boxed answer, a wrong answer, a parse failure or a check longer than ``timeout`` seconds: False.
    """
    return score_many([(response, gold)], timeout=timeout, workers=1)[0]
