"""Run untrusted Python (a policy's tool call) in a fresh, locked-down interpreter; docs/tool-use.md describes the
layers and what each one stops.

``run_python(code)`` starts ``python -I -S`` (isolated mode, no site hooks) as a new process per call, in a new
session, with an empty environment (only PATH, HOME/TMPDIR = the scratch directory, LANG and single-thread BLAS
settings), a fresh scratch directory as cwd (removed afterwards), stdin at /dev/null, and capped output. Inside,
a small supervisor (``_sandbox_child.py``) enforces the wall-clock limit and kills everything the code started.
Layers, outermost first (``SandboxResult.isolation`` lists those that held for a call; ``isolation_report()``
probes once and tells which this machine gives):

- **namespaces** (when unprivileged user namespaces work; probed once and cached): user, network (only a loopback
  that is down; abstract unix sockets are per-namespace too), mount, pid (the code is pid 1, so everything it
  started dies with it), IPC and UTS. The file system is read-only, with the home, temp and run folders behind
  empty tmpfs mounts and the interpreter's own folders bound back; the only writable place is the scratch
  directory, a size-capped tmpfs. A root caller's code runs as ``nobody`` (uid 65534), with no capabilities and
  ``no_new_privs``.
- **rlimits**: memory (RLIMIT_AS), CPU, file size, processes and threads (RLIMIT_NPROC, which Linux does not
  enforce for uid 0, hence ``nobody``), open files, no core files.
- **audit hook** (``sys.addaudithook``, before the code runs; best effort, PEP 578 hooks are no security boundary
  on their own): network calls, writes outside the scratch directory, new processes (unless
  ``allow_subprocess``), signals to other processes, other processes' ``/proc``, ctypes, gc introspection and
  swapping a function's code.

Without user namespaces (``isolation == "basic"``: e.g. Docker's default seccomp profile) the supervisor is a child
subreaper that kills the code's orphans, a root caller's code still runs as ``nobody`` (folders nobody cannot
enter are reached through ``/proc/self/fd``), and the audit hook also refuses reads outside an allow-list; the
network and the files the code's uid may use are then guarded by the audit hook only.

``STARE_SANDBOX_ISOLATION`` = ``auto`` (namespaces when available, else the fallback, silently), ``namespaces``
(fail when unavailable) or ``basic`` (the fallback). ``run_python`` alone defaults to ``auto``; the tool loop
(``stare eval --tools``, the training agent: ``stare.cli.agent.loop.ToolConfig``) defaults to ``namespaces`` and
checks it up front with ``resolve_isolation``, which raises ``SandboxError`` with one line (the isolation, why it
is unavailable here, what to set instead). ``SandboxResult.isolation_used`` says which one a call ran with.
"""
from __future__ import annotations

import functools
import json
import os
import re
import select
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SandboxResult", "SandboxError", "run_python", "isolation_report", "resolve_isolation",
           "namespaces_available", "CHILD_SCRIPT"]

CHILD_SCRIPT = str(Path(__file__).with_name("_sandbox_child.py"))
ISOLATION_MODES = ("auto", "namespaces", "basic")
_STARTUP_TIMEOUT_S = 30.0  # interpreter start + handshake, not counted in the code's time limit
_GRACE_S = 5.0  # past the code's limit before the caller kills the supervisor itself
_ns_state: dict = {}  # cached probe: {"available": bool, "error": str | None}
_ns_lock = threading.Lock()


class SandboxError(RuntimeError):
    """The sandbox could not be set up as asked (e.g. ``isolation="namespaces"`` where there are none)."""


@dataclass
class SandboxResult:
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None  # None when killed by a signal
    signal: int | None = None
    timed_out: bool = False
    error_kind: str | None = None  # None | syntax | exception | timeout | cpu_limit | memory | blocked |
    # output_limit | killed | sandbox
    error: str | None = None  # one line saying what went wrong, for the observation
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    isolation: list[str] = field(default_factory=list)  # the layers that held
    isolation_used: str | None = None  # namespaces | basic (None: the sandbox did not start)
    notes: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error_kind is None


# --------------------------------------------------------------------------------------------------
# output capture
# --------------------------------------------------------------------------------------------------


class _Capture(threading.Thread):
    """Drains one pipe; keeps at most ``hard_cap`` bytes and sets ``overflow`` past it (the run is then killed)."""

    def __init__(self, pipe, hard_cap: int, overflow: threading.Event):
        super().__init__(daemon=True)
        self.pipe, self.hard_cap, self.overflow = pipe, hard_cap, overflow
        self.data = bytearray()
        self.dropped = 0

    def run(self):
        fd = self.pipe.fileno()
        try:
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                room = self.hard_cap - len(self.data)
                if room > 0:
                    self.data += chunk[:room]
                self.dropped += max(0, len(chunk) - max(room, 0))
                if self.dropped:
                    self.overflow.set()
        except OSError:
            pass


def _clip(data: bytes, dropped: int, limit: int) -> tuple[str, bool]:
    """Decoded text, at most ``limit`` characters: the head and the tail with a marker between them."""
    text = bytes(data).decode("utf-8", errors="replace")
    if len(text) <= limit and not dropped:
        return text, False
    cut = len(text) - limit + dropped
    head = limit // 2
    tail = limit - head
    marker = f"\n... [{cut} characters cut] ...\n"
    return text[:head] + marker + (text[-tail:] if tail else ""), True


# --------------------------------------------------------------------------------------------------
# the call
# --------------------------------------------------------------------------------------------------


def _isolation_mode(isolation: str | None) -> str:
    mode = isolation or os.environ.get("STARE_SANDBOX_ISOLATION", "auto")
    if mode not in ISOLATION_MODES:
        raise SandboxError(f"unknown sandbox isolation {mode!r}; valid: {', '.join(ISOLATION_MODES)}")
    return mode


def unavailable_message(error: str | None) -> str:
    """The one line for ``namespaces`` asked for where user namespaces cannot be made (``error``: the probe's)."""
    return (f"sandbox isolation 'namespaces' is unavailable here: this process may not create user namespaces "
            f"({error or 'the probe failed'}; Docker's default seccomp and AppArmor profiles forbid them, and so "
            "does kernel.apparmor_restrict_unprivileged_userns=1); run the container with --security-opt "
            "seccomp=unconfined --security-opt apparmor=unconfined (or a profile that allows unshare and mount), or "
            "set STARE_SANDBOX_ISOLATION=auto to accept the audit-hook fallback (no kernel isolation)")


def namespaces_available() -> tuple[bool, str | None]:
    """Whether the sandbox gets its namespaces on this machine, and why not: the supervisor's own ``unshare``, run
    once by a probe call and cached for the process (as every call's)."""
    if "available" not in _ns_state:
        res = run_python("pass", timeout_s=20, isolation="auto")
        if "available" not in _ns_state:  # the sandbox did not even start
            return False, res.error
    return bool(_ns_state["available"]), _ns_state.get("error")


def resolve_isolation(isolation: str | None = None) -> str:
    """The isolation calls with ``isolation`` (default: ``STARE_SANDBOX_ISOLATION``, else ``auto``) get here:
    ``namespaces`` or ``basic``. ``SandboxError`` with ``unavailable_message`` for ``namespaces`` where there are
    none."""
    mode = _isolation_mode(isolation)
    if mode == "basic":
        return "basic"
    available, error = namespaces_available()
    if available:
        return "namespaces"
    if mode == "namespaces":
        raise SandboxError(unavailable_message(error))
    return "basic"


def _unique(paths) -> list[str]:
    out: list[str] = []
    for p in paths:
        if p and p not in out:
            out.append(p)
    return out


def _site_dirs() -> list[str]:
    """The caller's site-packages folders, in its order: a venv's own and, with ``--system-site-packages``, the
    base interpreter's (the sandbox runs ``-S``, so it sees only what is passed here)."""
    try:
        found = list(site.getsitepackages())
    except AttributeError:  # an old virtualenv's site module
        found = []
    return _unique(found + [sysconfig.get_paths()[k] for k in ("purelib", "platlib")])


def _interpreter_dirs(python: str | None) -> list[str]:
    """Folders the sandboxed interpreter needs besides ``sys.path``: its prefix (a venv's root holds
    ``pyvenv.cfg`` and ``bin/``), the base prefix, and the folder of the executable as named and as resolved,
    so that ``sys.executable`` exists inside the sandbox wherever the venv lives."""
    exe = python or sys.executable
    dirs = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix] if python is None else []
    return _unique(dirs + [os.path.dirname(os.path.abspath(exe)), os.path.dirname(os.path.realpath(exe))])


def _write_id_maps(pid: int) -> bool:
    """Map ids into the sandbox's user namespace from here (its parent namespace). Root maps itself and nobody
    (the code then runs as nobody); another user maps only itself. True when nobody is mapped."""
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:
        Path(f"/proc/{pid}/uid_map").write_text("0 0 1\n65534 65534 1\n")
        Path(f"/proc/{pid}/gid_map").write_text("0 0 1\n65534 65534 1\n")
        return True
    Path(f"/proc/{pid}/setgroups").write_text("deny")
    Path(f"/proc/{pid}/uid_map").write_text(f"{uid} {uid} 1\n")
    Path(f"/proc/{pid}/gid_map").write_text(f"{gid} {gid} 1\n")
    return False


class _Status:
    """Line-delimited JSON messages from the sandbox's status pipe."""

    def __init__(self, fd: int):
        self.fd, self.buf, self.messages, self.eof = fd, b"", [], False

    def next(self, deadline: float) -> dict | None:
        while True:
            if b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                msg = json.loads(line)
                self.messages.append(msg)
                return msg
            if self.eof:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    self.eof = True
                self.buf += chunk

    def stage(self, name: str) -> dict | None:
        return next((m for m in self.messages if m.get("stage") == name), None)

    def until(self, name: str, deadline: float) -> dict | None:
        """The first message of stage ``name``, reading on past others (kept for ``stage``); None at the deadline or
        the end of the pipe. The supervisor writes "started" after its fork, and the runner it forked may report
        "layers" first: the order of the two is the scheduler's."""
        found = self.stage(name)
        while found is None:
            msg = self.next(deadline)
            if msg is None:
                return None
            if msg.get("stage") == name:
                found = msg
        return found


def _kill(proc: subprocess.Popen, child_pid: int | None) -> None:
    for target in (child_pid,):
        if target:
            try:
                os.kill(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python(code: str, *, timeout_s: float = 10.0, cpu_s: float | None = None, memory_mb: int = 1024,
               max_output_chars: int = 8192, nproc: int = 32, file_size_mb: int = 16, scratch_mb: int = 64,
               allow_subprocess: bool = False, isolation: str | None = None, python: str | None = None,
               repl_last_expr: bool = True, _audit: bool = True, _tag: str | None = None) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter and return what it printed and how it ended. Never raises
    for anything the code does; raises ``SandboxError`` only for a bad ``isolation``.

    ``timeout_s``: wall clock for the code; ``cpu_s``: CPU seconds (default ``timeout_s``); ``memory_mb``:
    address space; ``nproc``: processes + threads (its uid's, within the sandbox's user namespace when there is
    one); ``file_size_mb``: largest file; ``scratch_mb``: the scratch tmpfs (namespaces only);
    ``max_output_chars``: per stream, head and tail kept; output past 64x that (at least 1 MiB) kills the run.
    ``repl_last_expr``: a final bare expression is printed, as in a notebook. ``_audit``/``_tag`` are for tests.
    """
    mode = _isolation_mode(isolation)
    want_ns = mode != "basic" and _ns_state.get("available", True)
    if mode == "namespaces" and not want_ns:
        raise SandboxError(unavailable_message(_ns_state.get("error")))
    start = time.monotonic()
    scratch = os.path.realpath(tempfile.mkdtemp(prefix="stare-sandbox-"))
    os.chmod(scratch, 0o755)
    tag = _tag or f"stare-sandbox-{uuid.uuid4().hex[:12]}"
    cfg = {
        "code": code, "namespaces": want_ns, "scratch": scratch, "caller_uid": os.geteuid(),
        "caller_pid": os.getpid(), "allow_subprocess": bool(allow_subprocess), "audit": bool(_audit),
        "repl_last_expr": bool(repl_last_expr),
        "site_dirs": _site_dirs(),
        "interpreter_dirs": _interpreter_dirs(python),
        "limits": {"timeout_s": float(timeout_s), "cpu_s": max(1, int(round(cpu_s if cpu_s is not None else timeout_s))),
                   "memory_mb": int(memory_mb), "nproc": int(nproc), "file_size_mb": int(file_size_mb)},
        "scratch_mb": int(scratch_mb),
    }
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
           "LC_ALL": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    r_status, w_status = os.pipe()
    hard_cap = max(64 * max_output_chars, 1 << 20)
    overflow = threading.Event()
    result = SandboxResult()
    proc = None
    child_pid = None
    try:
        proc = subprocess.Popen([python or sys.executable, "-I", "-S", CHILD_SCRIPT, tag, str(w_status)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=scratch,
                                env=env, start_new_session=True, pass_fds=(w_status,), close_fds=True)
        os.close(w_status)
        w_status = None
        out = _Capture(proc.stdout, hard_cap, overflow)
        err = _Capture(proc.stderr, hard_cap, overflow)
        out.start()
        err.start()
        status = _Status(r_status)
        proc.stdin.write((json.dumps(cfg) + "\n").encode())
        proc.stdin.flush()
        ready = status.next(time.monotonic() + _STARTUP_TIMEOUT_S)
        if ready is None or ready.get("stage") != "ready":
            raise _Failed("the sandbox did not start")
        if want_ns and "available" not in _ns_state:
            with _ns_lock:
                _ns_state.setdefault("available", bool(ready["namespaces"]))
                _ns_state.setdefault("error", ready.get("error"))
        if mode == "namespaces" and not ready["namespaces"]:
            raise _Failed(unavailable_message(ready.get("error")), fatal=True)
        result.isolation_used = "namespaces" if ready["namespaces"] else "basic"
        mapped_nobody = False
        if ready["namespaces"]:
            try:
                mapped_nobody = _write_id_maps(int(ready["pid"]))
            except OSError as exc:
                result.notes.append(f"could not map ids into the namespace ({exc})")
        proc.stdin.write((json.dumps({"go": True, "mapped_nobody": mapped_nobody}) + "\n").encode())
        proc.stdin.close()
        started = status.until("started", time.monotonic() + _STARTUP_TIMEOUT_S)
        if started is None:
            raise _Failed("the sandbox did not start its runner")
        child_pid = int(started["child"])
        deadline = time.monotonic() + float(timeout_s) + _STARTUP_TIMEOUT_S + _GRACE_S
        while proc.poll() is None:
            if overflow.is_set():
                _kill(proc, child_pid)
                break
            if time.monotonic() > deadline:
                _kill(proc, child_pid)
                result.notes.append("the supervisor overran its limit and was killed")
                break
            status.next(time.monotonic() + 0.05)
        proc.wait()
        while status.next(time.monotonic() + 1.0) is not None:
            pass
        _kill(proc, child_pid)  # stragglers of the fallback that left the process group
        for t in (out, err):
            t.join(timeout=2.0)
        layers = status.stage("layers") or {}
        done = status.stage("done") or {}
        result.isolation = ["fresh_interpreter", "empty_env", "process_group", "wall_clock_kill"] + \
            list(layers.get("layers", []))
        if not ready["namespaces"]:
            result.isolation.append("subreaper")
        result.notes += list(layers.get("notes", []))
        result.stdout, result.stdout_truncated = _clip(out.data, out.dropped, max_output_chars)
        result.stderr, result.stderr_truncated = _clip(err.data, err.dropped, max_output_chars)
        result.exit_code = done.get("exit_code")
        result.signal = done.get("signal")
        result.timed_out = bool(done.get("timed_out"))
        _classify(result, overflow.is_set(), layers, done, cfg["limits"])
    except _Failed as exc:
        if proc is not None:
            _kill(proc, child_pid)
        if exc.fatal:
            raise SandboxError(str(exc)) from None
        result.error_kind, result.error = "sandbox", f"sandbox failure: {exc}"
    except OSError as exc:  # cannot start a process at all (e.g. out of pids): report it, do not crash the caller
        if proc is not None:
            _kill(proc, child_pid)
        result.error_kind, result.error = "sandbox", f"sandbox failure: {exc}"
    finally:
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    if pipe:
                        pipe.close()
                except OSError:
                    pass
        for fd in (r_status, w_status):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        shutil.rmtree(scratch, ignore_errors=True)
        result.duration_s = time.monotonic() - start
    return result


class _Failed(Exception):
    def __init__(self, msg: str, fatal: bool = False):
        super().__init__(msg)
        self.fatal = fatal


def _last_exception_line(stderr: str) -> str:
    """The last ``Name: message`` line (forked children may interleave their tracebacks)."""
    for line in reversed(stderr.strip().splitlines()):
        if line and not line[0].isspace() and not line.startswith(_TRACEBACK_HEADERS):
            return line.strip()
    return ""


_TRACEBACK_HEADERS = ("Traceback (most recent call last)", "During handling of the above exception",
                      "The above exception was the direct cause", "...")


_VIOLATION = re.compile(r"SandboxViolation: (sandbox: [^\n]*)")


def _classify(r: SandboxResult, overflowed: bool, layers: dict, done: dict, limits: dict) -> None:
    last = _last_exception_line(r.stderr)
    exc_name = last.split(":", 1)[0].rsplit(".", 1)[-1] if last else ""
    if overflowed:
        r.error_kind, r.error = "output_limit", "the code printed too much output and was stopped"
    elif layers.get("failed") or not done:
        r.error_kind = "sandbox"
        r.error = f"sandbox failure: {layers.get('failed') or 'no exit status'}"
    elif r.timed_out:
        r.error_kind, r.error = "timeout", f"the code ran longer than {limits['timeout_s']:g} s and was stopped"
    elif r.signal in (signal.SIGXCPU,) or (r.signal == signal.SIGKILL and not r.timed_out):
        r.error_kind, r.error = "cpu_limit", f"the code used more than {limits['cpu_s']} s of CPU and was stopped"
    elif r.signal is not None:
        r.error_kind, r.error = "killed", f"the code was killed by signal {signal.Signals(r.signal).name}"
    elif r.exit_code == 0:
        return
    elif (violation := _VIOLATION.findall(r.stderr)) or "sandbox: " in last:
        # also when the code's own libraries wrapped it (urllib: URLError(<urlopen error sandbox: ...>))
        r.error_kind = "blocked"
        r.error = violation[-1].strip() if violation else last[last.index("sandbox: "):].rstrip(">").strip()
    elif exc_name.endswith("MemoryError"):
        r.error_kind, r.error = "memory", f"the code ran out of memory (limit {limits['memory_mb']} MB)"
    elif exc_name in ("SyntaxError", "IndentationError", "TabError"):
        r.error_kind, r.error = "syntax", last
    elif last:
        r.error_kind, r.error = "exception", last
    else:
        r.error_kind, r.error = "exception", f"the code exited with status {r.exit_code}"


@functools.lru_cache(maxsize=1)
def isolation_report() -> dict:
    """Which layers this machine gives, from one probe run (cached for the process)."""
    res = run_python("print('ok')", timeout_s=20)
    return {"namespaces": bool(_ns_state.get("available")), "namespace_error": _ns_state.get("error"),
            "layers": res.isolation, "notes": res.notes, "probe_ok": res.ok and res.stdout.strip() == "ok"}
