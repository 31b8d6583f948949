"""Stopping on SIGINT (Ctrl-C) and SIGTERM: no new work starts, running workers stop, finished work is kept.

``stare run``, ``stare train`` and ``stare eval`` run under ``stop_on_signals``. The first SIGINT or SIGTERM raises
``Stopped`` wherever the main thread is, unless it is inside a ``critical`` block (a checkpoint or a sample line
being written), which finishes first. ``Stopped`` is a ``KeyboardInterrupt``: the waits of Ray and torch turn a
pending interrupt into a KeyboardInterrupt of their own, so those end the same way (the signal is remembered here).
The command stops the processes it started (``stop_processes``: SIGTERM, a grace period of ``GRACE_S``, then
SIGKILL), and ``stop_on_signals`` prints one line (what was stopped, the exact ``--resume`` command) and exits with
128 + the signal: 130 for SIGINT, 143 for SIGTERM. A second signal kills every process registered with ``track`` at
once and exits.

Worker processes (``worker_setup``: the local engine's arms and warm starts) ignore SIGINT, since a terminal's Ctrl-C
reaches the whole process group and their parent decides; on SIGTERM they exit at once, or at the end of the
``critical`` block they are in. ``die_with_parent`` makes the kernel send them SIGTERM when their parent dies (Linux),
so no worker outlives a parent that was killed outright.
"""
from __future__ import annotations

import functools
import os
import shlex
import signal
import sys
import threading
import time
from contextlib import contextmanager

GRACE_S = 10.0  # how long a stopped worker may take to leave (SIGTERM) before it is killed (SIGKILL)
SIGNALS = (signal.SIGINT, signal.SIGTERM)
PARENT_ENV = "STARE_PARENT_PID"  # set for a ``stare`` child process that must die with the process that started it


class Stopped(KeyboardInterrupt):
    """Raised in the main thread by the first SIGINT or SIGTERM."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _State:
    def __init__(self):
        self.signum: int | None = None  # the signal that asked to stop
        self.critical = 0  # depth of critical blocks in the main thread
        self.worker = False  # this process is a worker: exit instead of raising
        self.active = False  # a command runs under stop_on_signals
        self.what: list[str] = []  # what the command stopped, for its last line
        self.procs: dict[int, tuple[object, bool]] = {}  # pid -> (process, signal its whole group)
        self.lock = threading.Lock()


_state = _State()


def exit_code(signum: int) -> int:
    return 128 + int(signum)


def requested() -> int | None:
    """The signal that asked this process to stop, or None."""
    return _state.signum


def _handler(signum, frame):
    if _state.signum is not None and not _state.worker:  # the second signal: now
        kill_tracked()
        os._exit(exit_code(_state.signum))
    _state.signum = _state.signum or signum
    if _state.critical:
        return  # the block ends first (``critical`` acts on it)
    if _state.worker:
        os._exit(exit_code(signum))
    raise Stopped(signum)


@contextmanager
def critical():
    """A block a stop does not cut (a checkpoint's renames, a record's write): a signal during it acts at its end."""
    _state.critical += 1
    try:
        yield
    finally:
        _state.critical -= 1
    if not _state.critical and _state.signum is not None:
        if _state.worker:
            os._exit(exit_code(_state.signum))
        raise Stopped(_state.signum)


def _install() -> dict:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, _handler) for s in SIGNALS}


def reclaim() -> None:
    """Install the handlers again after a library replaced them (``ray.init`` sets its own SIGTERM handler, which
    exits with status 15 and says nothing)."""
    if _state.active:
        _install()


def worker_setup(parent_pid: int | None = None) -> None:
    """In a worker process (a ``ProcessPoolExecutor`` initializer): ignore SIGINT, exit on SIGTERM (after a
    ``critical`` block), and die with the parent."""
    _state.worker = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # also drops a SIGINT held back while it started (``spawning``)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGTERM, _handler)
    die_with_parent(parent_pid)


@contextmanager
def spawning():
    """Around the start of worker processes: SIGINT is held back (blocked) in this thread, so a child starts with it
    blocked and a Ctrl-C in its first second (its interpreter still importing, before ``worker_setup``) cannot kill
    it half-started. The block is also ``critical``: a signal that reaches this process meanwhile (through another
    of its threads, where SIGINT is not blocked, or a SIGTERM) acts when the block ends, not while the parent is
    still writing a child's start-up data down its pipe (a child cut off there dies of EOFError, unseen)."""
    with critical():
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def submit(pool, fn, *args):
    """``pool.submit(fn, *args)`` for a ``ProcessPoolExecutor`` whose workers run ``worker_setup``: a submit may
    start a worker, so it runs under ``spawning``."""
    with spawning():
        return pool.submit(fn, *args)


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent ends (Linux's ``PR_SET_PDEATHSIG``; elsewhere
    nothing). ``parent_pid``: the parent expected; a parent already gone is acted on at once."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
            return
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)


def child_env(environ=None) -> dict:
    """The environment of a ``stare`` child process that must not outlive this one (see ``from_env``)."""
    return {**(os.environ if environ is None else environ), PARENT_ENV: str(os.getpid())}


def from_env() -> None:
    """At a ``stare`` command's start: die with the parent that asked for it (``child_env``)."""
    parent = os.environ.pop(PARENT_ENV, "")
    if parent.isdigit():
        die_with_parent(int(parent))


# ---- the processes a command started --------------------------------------------------------------------------

def track(proc, *, group: bool = False) -> None:
    """Register a child process (``subprocess.Popen`` or ``multiprocessing.Process``) to kill on a second signal;
    ``group``: it leads its own process group (``start_new_session``), signalled as a whole."""
    with _state.lock:
        _state.procs[proc.pid] = (proc, group)


def untrack(proc) -> None:
    with _state.lock:
        _state.procs.pop(proc.pid, None)


def _alive(proc) -> bool:
    if hasattr(proc, "poll"):
        return proc.poll() is None
    return proc.is_alive()


def _send(proc, group: bool, sig: int) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tracked() -> None:
    with _state.lock:
        procs = list(_state.procs.values())
    for proc, group in procs:
        _send(proc, group, signal.SIGKILL)


def stop_processes(procs, *, group: bool = False, grace: float | None = None) -> int:
    """SIGTERM to each process, SIGKILL to those still there after ``grace`` seconds (to the whole group of each
    with ``group``, and to the group of one that left, for what it started there); returns how many were running.
    Every one has ended when this returns. The SIGTERM goes to the process alone: a ``stare train`` stops its own
    Ray head and workers in order, which a SIGTERM to all of them at once would not let it do."""
    grace = GRACE_S if grace is None else grace
    running = [p for p in procs if _alive(p)]
    for p in running:
        _send(p, False, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(_alive(p) for p in running) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in running:
        if _alive(p):
            _send(p, group, signal.SIGKILL)
        elif group:  # the leader left: whatever it started in its group goes too
            _send(p, True, signal.SIGKILL)
    for p in running:
        (p.wait if hasattr(p, "wait") else p.join)(5)
    return len(running)


def report(what: str) -> None:
    """Say what was stopped (printed in the command's last line)."""
    _state.what.append(what)


def resume_command(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    return "stare " + shlex.join(argv + ([] if "--resume" in argv else ["--resume"]))


@contextmanager
def stop_on_signals(say=None):
    """Run a command so that SIGINT and SIGTERM stop it: see the module's docstring. ``say`` prints a line (on
    standard error by default)."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    from_env()
    _state.signum, _state.what = None, []
    previous = _install()
    _state.active = bool(previous)
    try:
        yield
    except KeyboardInterrupt:
        signum = _state.signum or signal.SIGINT
        _state.signum = signum  # a second signal from here on kills at once
        stopped = "; ".join(_state.what) or "nothing was running"
        say(f"stopped by {signal.Signals(signum).name}: {stopped}; what finished is kept. Continue with: "
            f"{resume_command()}")
        raise SystemExit(exit_code(signum)) from None
    finally:
        _state.active = False
        for s, h in previous.items():
            signal.signal(s, h)


def stoppable(command):
    """A decorator for a long command that SIGINT (Ctrl-C) and SIGTERM stop cleanly (``stop_on_signals``, its
    messages on stderr as plain text)."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from .errors import err_console, plain

        with stop_on_signals(plain(err_console)):
            return command(*args, **kwargs)
    return wrapper
