"""One writer per folder: a run folder (``stare train``, ``stare run``) or an evaluation folder (``stare eval``) is
locked while a process writes it.

The lock is ``FOLDER/.stare-lock``, held with ``flock`` by the writing process (the kernel lets go when the process
ends, however it ends) and naming its PID, host, start time and command. A second writer of the folder, or of a
folder inside it, is refused in one line (``FolderLocked``, exit 2) before it reads or changes anything. A lock file
left by a process that has ended is taken over, with a warning. A process's children that write inside its folder
(``stare run`` on GPU presets starts ``stare train`` and ``stare eval``) are given its locks (``child_env``).
Readers (``stare compare``) take no lock.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from .errors import CliError

LOCK_NAME = ".stare-lock"
HELD_ENV = "STARE_HELD_LOCKS"  # lock files a parent holds for its children (os.pathsep-separated)


class FolderLocked(CliError):
    """Another live process writes the folder (exit 2)."""


def _lock_path(folder: Path) -> Path:
    return Path(os.path.abspath(folder)) / LOCK_NAME


def _held_by_parent() -> set[str]:
    return {p for p in os.environ.get(HELD_ENV, "").split(os.pathsep) if p}


def _read_holder(path: Path) -> dict:
    try:
        holder = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict) -> str:
    if not holder:
        return "another process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return (f"PID {holder.get('pid', '?')} on {holder.get('host', '?')} (since {since}: "
            f"{holder.get('command', '?')})")


def _try_lock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: this file system has no ``flock``."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise


def _pid_alive(holder: dict) -> bool:
    """Whether the holder named in a lock file runs (known only on its own host; another host's counts as alive)."""
    if holder.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(holder.get("pid", -1)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OverflowError):
        return True
    return True


def _refusal(folder: Path, holder: dict) -> FolderLocked:
    return FolderLocked(f"{folder} is being written by {_describe(holder)}; wait for it to finish or stop it "
                        f"(Ctrl-C, or kill {holder.get('pid', 'PID')}), then run again (nothing was changed)")


def _holder_if_live(path: Path) -> dict | None:
    """The holder of the lock file at ``path`` if a live process holds it, else None (no file, or a stale one)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        got = _try_lock(fd)
        holder = _read_holder(path)
        if got is None:  # no flock here: the PID decides
            return holder if holder and _pid_alive(holder) else None
        return None if got else holder
    finally:
        os.close(fd)  # closing lets go of a lock taken just to look


def check_free(folder: Path) -> None:
    """``FolderLocked`` when a live process other than this one's parent writes ``folder`` or a folder holding it;
    reads only."""
    folder = Path(os.path.abspath(folder))
    mine = _held_by_parent() | set(_HELD)
    for d in (folder, *folder.parents):
        path = d / LOCK_NAME
        if str(path) in mine:
            continue
        holder = _holder_if_live(path)
        if holder is not None:
            raise _refusal(d, holder)


_HELD: dict[str, int] = {}  # lock files this process holds -> their descriptors


@contextmanager
def hold(folder: Path, *, warn=None):
    """Hold ``folder``'s lock for the block (making the folder if needed; one this made and left empty is removed
    at the end). ``FolderLocked`` when a live process holds it or a folder above it; a stale lock is taken over
    with a warning (``warn``, a function of one line; standard error by default)."""
    warn = warn or (lambda line: print(f"warning: {line}", file=sys.stderr, flush=True))
    folder = Path(os.path.abspath(folder))
    check_free(folder.parent)
    path = folder / LOCK_NAME
    if str(path) in _HELD:  # held already by this process (stare run's folder, then its arms')
        yield
        return
    made = [d for d in (folder, *folder.parents) if not d.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    fd = None
    try:
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            got = _try_lock(fd)
            holder = _read_holder(path)
            if got is False or (got is None and holder and holder.get("pid") != os.getpid() and _pid_alive(holder)):
                raise _refusal(folder, holder)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed the file as it let go: lock the new one
            fd = None
        if holder:
            warn(f"{folder}: took over the lock of {_describe(holder)}, which is no longer running")
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                                 "command": " ".join(["stare", *sys.argv[1:]])}).encode())
        os.fsync(fd)
        _HELD[str(path)] = fd
        try:
            yield
        finally:
            _HELD.pop(str(path), None)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    finally:
        if fd is not None:
            os.close(fd)
        for d in made:  # innermost first: the folders this made, if nothing else was written there
            try:
                d.rmdir()
            except OSError:
                break


def child_env(environ=None) -> dict:
    """The environment for a child process that writes inside the folders this process holds."""
    environ = dict(os.environ if environ is None else environ)
    held = [p for p in environ.get(HELD_ENV, "").split(os.pathsep) if p] + list(_HELD)
    environ[HELD_ENV] = os.pathsep.join(dict.fromkeys(held))
    return environ


def without_lock(paths) -> list:
    """``paths`` (a folder's entries) less the lock file: a folder holding only a lock is empty."""
    return [p for p in paths if Path(p).name != LOCK_NAME]
