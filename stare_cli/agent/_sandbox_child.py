"""The sandbox's in-process side: a supervisor and the process that runs the untrusted code.

Started by ``stare.cli.agent.sandbox.run_python`` as ``python -I -S _sandbox_child.py TAG STATUS_FD`` with an
empty environment, in a new session, with the scratch directory as cwd. Standard library only; never imported
by the package (the caller only passes this file's path).

Protocol (stdin: caller -> supervisor, STATUS_FD: supervisor/child -> caller, one JSON object per line):

1. caller -> ``{"code": ..., "limits": ..., "namespaces": bool, ...}``
2. the supervisor tries ``unshare(user | net | pid | ipc | uts)`` when asked (the runner makes its own mount
   namespace), then reports
   ``{"stage": "ready", "namespaces": bool, "pid": PID}``. With namespaces the caller, which is in the parent
   user namespace, writes this process's ``uid_map``/``gid_map`` (a process cannot map more than itself).
3. caller -> ``{"go": true, "mapped_nobody": bool}``
4. the supervisor forks the runner (pid 1 of the new pid namespace, or a plain child as the fallback) and
   reports ``{"stage": "started", "child": PID}``; the runner sets up its layers, reports
   ``{"stage": "layers", ...}``, closes the status pipe and runs the code with stdout/stderr going straight to
   the caller.
5. the supervisor waits (wall-clock limit), kills whatever is left and reports
   ``{"stage": "done", "exit_code": .., "signal": .., "timed_out": ..}``.
"""
import ast
import builtins
import json
import linecache
import os
import re
import resource
import select
import signal
import sys
import time
import traceback
import types

# Linux constants (the same on x86_64 and aarch64; syscalls numbered >= 424 are shared by all architectures)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_SET_SECUREBITS = 1, 36, 38, 28
SECBITS_LOCK_ROOT = 0x2F  # NOROOT | NOROOT_LOCKED | NO_SETUID_FIXUP | NO_SETUID_FIXUP_LOCKED | KEEP_CAPS_LOCKED
NOBODY = 65534
# directories hidden behind an empty read-only tmpfs inside the mount namespace (secrets, other jobs' sockets
# and temp files); the interpreter's own folders under them are bound back read-only
HIDDEN_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/root", "/home", "/mnt", "/media", "/srv")


class _Libc:
    def __init__(self):
        import ctypes

        self.ctypes = ctypes
        self.lib = ctypes.CDLL(None, use_errno=True)

    def _check(self, rc, what):
        if rc != 0:
            err = self.ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def unshare(self, flags):
        self._check(self.lib.unshare(flags), "unshare")

    def mount(self, source, target, fstype, flags, data=None):
        c = self.ctypes
        enc = lambda s: None if s is None else s.encode()  # noqa: E731
        rc = self.lib.mount(enc(source), enc(target), enc(fstype), c.c_ulong(flags), enc(data))
        self._check(rc, f"mount {target}")

    def mount_setattr(self, path, attr_set, recursive=True):
        c = self.ctypes

        class MountAttr(c.Structure):
            _fields_ = [("attr_set", c.c_uint64), ("attr_clr", c.c_uint64), ("propagation", c.c_uint64),
                        ("userns_fd", c.c_uint64)]

        attr = MountAttr(attr_set, 0, 0, 0)
        flags = AT_RECURSIVE if recursive else 0
        rc = self.lib.syscall(c.c_long(SYS_MOUNT_SETATTR), c.c_int(AT_FDCWD), path.encode(), c.c_uint(flags),
                              c.byref(attr), c.c_size_t(c.sizeof(attr)))
        self._check(rc, f"mount_setattr {path}")

    def prctl(self, option, arg):
        c = self.ctypes
        self._check(self.lib.prctl(c.c_int(option), c.c_ulong(arg), c.c_ulong(0), c.c_ulong(0), c.c_ulong(0)),
                    f"prctl {option}")

    def drop_capabilities(self):
        c = self.ctypes
        nr = SYS_CAPSET.get(os.uname().machine)
        if nr is None:
            raise OSError(0, "capset: unknown architecture")

        class Header(c.Structure):
            _fields_ = [("version", c.c_uint32), ("pid", c.c_int)]

        class Data(c.Structure):
            _fields_ = [("effective", c.c_uint32), ("permitted", c.c_uint32), ("inheritable", c.c_uint32)]

        data = (Data * 2)()  # all zero: no capability at all
        self._check(self.lib.syscall(c.c_long(nr), c.byref(Header(0x20080522, 0)), data), "capset")


def _write_status(fd, **msg):
    os.write(fd, (json.dumps(msg) + "\n").encode())


def _read_line():
    line = sys.stdin.buffer.readline()
    if not line:
        os._exit(70)  # the caller went away
    return json.loads(line)


# --------------------------------------------------------------------------------------------------
# the runner: layers, then the code
# --------------------------------------------------------------------------------------------------


def _covering(paths):
    """The given existing directories, minus those inside another one."""
    out = []
    for p in sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)}):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


def _interpreter_folders(cfg):
    """What the code's interpreter reads: ``sys.path``, the caller's site-packages and its prefix folders (a venv's
    root and ``bin/``, wherever it lives)."""
    return _covering(list(sys.path) + list(cfg.get("site_dirs", [])) + list(cfg.get("interpreter_dirs", [])) +
                     [os.path.dirname(os.path.realpath(sys.executable))])


def _reroute_unreachable(folders):
    """Make ``folders`` importable after the switch to ``nobody`` even where a parent is closed to it (a venv
    under /root): each one nobody cannot reach is opened now (``O_PATH``) and ``sys.path``, the passed
    site-packages and every loaded package's ``__path__`` are pointed at ``/proc/self/fd/N/...``. A process
    always reaches its own descriptors, and from there on only the permissions of the folder itself and
    what lies below it count. Returns the descriptors (kept open for the process's life)."""
    fds = {d: os.open(d, os.O_PATH | os.O_DIRECTORY) for d in folders if not _traversable_by_others(d)}
    if not fds:
        return fds

    def moved(path):
        if not isinstance(path, str):
            return path
        real = os.path.realpath(path)
        for d in sorted(fds, key=len, reverse=True):
            if real == d or real.startswith(d + "/"):
                return f"/proc/self/fd/{fds[d]}" + real[len(d):]
        return path

    sys.path[:] = [moved(p) for p in sys.path]
    for module in list(sys.modules.values()):
        search = getattr(module, "__path__", None)
        if isinstance(search, list):
            search[:] = [moved(p) for p in search]
    return fds


def _become_nobody():
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _traversable_by_others(path):
    """Can a uid that owns nothing here reach and list ``path`` (o+x on every parent, o+rx on it)?"""
    parts = os.path.realpath(path).split("/")
    for i in range(1, len(parts) + 1):
        d = "/".join(parts[:i]) or "/"
        need = 0o005 if i == len(parts) else 0o001
        try:
            if os.stat(d).st_mode & need != need:
                return False
        except OSError:
            return False
    return True


def _setup_namespace_mounts(libc, cfg, scratch, layers, notes, owner):
    """Private /proc, everything read-only, secrets hidden, a size-capped tmpfs as the only writable place.

    In a mount namespace of the runner's own: the supervisor keeps its view of the file system (it may still
    need to load modules while this runs)."""
    libc.unshare(CLONE_NEWNS)
    libc.mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates back to the host
    layers.append("mount_namespace")
    try:
        libc.mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        layers.append("private_proc")
    except OSError as exc:
        notes.append(f"private /proc unavailable ({exc}); /proc shows the host's processes")
    keep = _interpreter_folders(cfg)
    fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in keep}
    try:
        libc.mount_setattr("/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)
        layers.append("readonly_fs")
    except OSError as exc:
        notes.append(f"read-only file system unavailable ({exc})")
    os.umask(0o022)
    hidden = []
    for d in HIDDEN_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            try:
                libc.mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
                hidden.append(d)
            except OSError as exc:
                notes.append(f"could not hide {d} ({exc})")
    # bind the interpreter's folders back (read-only) where a hidden directory covered them
    for p, fd in fds.items():
        if any(p == d or p.startswith(d + "/") for d in hidden):
            os.makedirs(p, exist_ok=True)
            libc.mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
            libc.mount_setattr(p, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)
        os.close(fd)
    os.makedirs(scratch, exist_ok=True)
    uid, gid = owner
    libc.mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV,
               f"size={int(cfg['scratch_mb'])}m,mode=700,uid={uid},gid={gid}")
    layers.append("scratch_tmpfs")
    for d in hidden:
        try:
            libc.mount_setattr(d, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, recursive=False)
        except OSError as exc:
            notes.append(f"could not make {d} read-only ({exc})")
    if hidden:
        layers.append("hidden_dirs")
    return keep


def _set_rlimits(limits, layers, notes):
    mb = 1024 * 1024
    wanted = [
        ("RLIMIT_AS", int(limits["memory_mb"]) * mb, int(limits["memory_mb"]) * mb),
        ("RLIMIT_CPU", int(limits["cpu_s"]), int(limits["cpu_s"]) + 1),
        ("RLIMIT_FSIZE", int(limits["file_size_mb"]) * mb, int(limits["file_size_mb"]) * mb),
        ("RLIMIT_NPROC", int(limits["nproc"]), int(limits["nproc"])),
        ("RLIMIT_NOFILE", 256, 256),
        ("RLIMIT_CORE", 0, 0),
    ]
    for name, soft, hard in wanted:
        try:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        except (ValueError, OSError) as exc:
            notes.append(f"{name} not set ({exc})")
    layers.append("rlimits")


def _install_audit_hook(scratch, allow_subprocess, protected_pids, read_ok=None):
    """Best-effort interpreter-level guard (PEP 578 hooks are not a security boundary on their own; the kernel
    layers are): no network, no writes outside scratch, no new processes, no ctypes calls, no other process's
    /proc entries, no tampering with the hook.

    ``read_ok`` (the fallback without a mount namespace, where the code sees the host's files): folders that may
    be read besides the scratch directory, ``/dev/null``, ``/dev/urandom`` and this process's own ``/proc``
    entries; every other open, directory listing or database is refused, and so are new symbolic links (a
    link swapped between the check and the open would lead outside)."""
    scratch = os.path.realpath(scratch)
    own_pid = os.getpid()
    guard_reads = read_ok is not None
    read_dirs = tuple(os.path.realpath(d).rstrip("/") + "/" for d in (read_ok or ()))
    read_files = frozenset({"/dev/null", "/dev/urandom", "/dev/random", "/dev/zero", "/dev/stdin", "/dev/stdout",
                            "/dev/stderr"})
    # this process's own /proc files (status, limits, maps, ...), not its magic links to other places
    own_proc = re.compile(rf"^/proc/(self|thread-self|{own_pid})(/task/\d+)?"
                          r"(/(?!(root|cwd|fd|fdinfo|map_files|exe)$)[^/]+)?$")
    protected = frozenset(protected_pids)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    write_ok = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr", "/dev/zero"})
    proc_entry = re.compile(r"^/proc/(\d+)(/|$)")
    process_events = frozenset({"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                                "subprocess.Popen", "os.startfile", "pty.spawn"})
    network_events = frozenset({"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
                                "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
                                "socket.gethostbyname_ex", "socket.getnameinfo", "socket.sethostname"})
    path_events = {  # event -> (positions of paths it changes, position of dir_fd arguments)
        "os.mkdir": ((0,), (2,)), "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)),
        "os.rename": ((0, 1), (2, 3)), "os.link": ((0, 1), (2, 3)), "os.symlink": ((1,), (2,)),
        "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)), "os.truncate": ((0,), ()),
        "os.utime": ((0,), (4,)), "os.chflags": ((0,), ()), "os.lchflags": ((0,), ()),
        "os.lchmod": ((0,), ()), "os.lchown": ((0,), ()), "os.setxattr": ((0,), ()),
        "os.removexattr": ((0,), ()), "os.mkfifo": ((0,), (2,)), "os.mknod": ((0,), (3,)),
        "shutil.chown": ((0,), ()), "shutil.rmtree": ((0,), (1,)), "os.chroot": ((0,), ()),
    }
    blocked_always = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents", "ctypes.dlsym",
                                "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata",
                                "ctypes.cdata/buffer", "ctypes.string_at", "ctypes.wstring_at", "ctypes.set_errno",
                                "ctypes.seh_exception", "sys.remote_exec", "cpython.remote_debugger_script"})

    class SandboxViolation(PermissionError):
        pass

    def deny(why):
        raise SandboxViolation(f"sandbox: {why}")

    def inside(path):
        if isinstance(path, int):
            return True  # an already open descriptor: its opening was checked
        try:
            p = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return p == scratch or p.startswith(scratch + "/") or p in write_ok

    def readable(path):
        if isinstance(path, int) or path is None:
            return True  # an open descriptor (its opening was checked) or the cwd (the scratch directory)
        try:
            p = os.path.realpath(os.fsdecode(path))  # symbolic and /proc magic links followed
        except (TypeError, ValueError):
            return False
        return (inside(p) or p in read_files or p.startswith(read_dirs) or (p + "/") in read_dirs or
                bool(own_proc.match(p)))

    read_events = {"os.listdir": 0, "os.scandir": 0, "sqlite3.connect": 0, "sqlite3.connect/handle": None,
                   "glob.glob": None}

    def hook(event, args):
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            if isinstance(path, (str, bytes)):
                m = proc_entry.match(os.path.realpath(os.fsdecode(path)))
                if m and int(m.group(1)) != own_pid:
                    deny(f"reading another process's /proc entry is not allowed ({os.fsdecode(path)})")
            writing = (isinstance(flags, int) and flags & write_flags) or \
                      (isinstance(mode, str) and any(c in mode for c in "wax+"))
            if writing and not inside(path):
                deny(f"writing outside the scratch directory is not allowed ({path!r})")
            if mode is None and not inside(path) and isinstance(path, (str, bytes)) and \
                    os.path.isdir(os.fsdecode(path)):
                deny(f"opening a directory outside the scratch directory is not allowed ({path!r})")
            if guard_reads and not readable(path):
                deny(f"reading outside the scratch directory and the interpreter's folders is not allowed ({path!r})")
        elif guard_reads and event in read_events:
            i = read_events[event]
            if i is not None and i < len(args) and not readable(args[i]) and args[i] != ":memory:":
                deny(f"reading outside the scratch directory and the interpreter's folders is not allowed "
                     f"({event} {args[i]!r})")
        elif guard_reads and event == "os.symlink":
            deny("creating symbolic links is not allowed")
        elif event in path_events:
            paths, dir_fds = path_events[event]
            if any(i < len(args) and args[i] not in (None, -1, AT_FDCWD) for i in dir_fds):
                deny(f"{event} relative to a directory descriptor is not allowed")
            for i in paths:
                if i < len(args) and not inside(args[i]):
                    deny(f"changing files outside the scratch directory is not allowed ({event} {args[i]!r})")
        elif event == "socket.__new__":
            if len(args) > 1 and args[1] not in (-1, 1):  # AF_UNIX pairs (asyncio's self-pipe) only
                deny("network access is disabled (socket)")
        elif event in network_events:
            deny(f"network access is disabled ({event})")
        elif event in process_events:
            if not allow_subprocess:
                deny(f"starting processes is not allowed ({event})")
        elif event in ("os.kill", "os.killpg"):
            pid = args[0]
            if pid in protected or (event == "os.kill" and pid < 0 and pid != -os.getpgid(0)) or \
                    (event == "os.killpg" and pid not in (0, os.getpgid(0))) or \
                    (not allow_subprocess and pid not in (0, own_pid)):
                deny(f"signalling other processes is not allowed ({event} {pid})")
        elif event == "resource.prlimit":
            if args[0] not in (0, own_pid):
                deny("changing another process's limits is not allowed")
        elif event == "object.__setattr__":
            if len(args) > 1 and args[1] in ("__code__", "__closure__", "__globals__"):
                deny(f"setting {args[1]} is not allowed")
        elif event == "ctypes.dlopen":
            if args and args[0] is not None:
                deny("loading shared libraries with ctypes is not allowed")
        elif event == "import":
            if not allow_subprocess and args and args[0] == "_posixsubprocess":
                deny("loading _posixsubprocess again is not allowed")
        elif event in blocked_always:
            deny(f"{event} is not allowed")

    if not allow_subprocess:
        # subprocess talks to _posixsubprocess directly, past the "subprocess.Popen" event; numpy and sympy import
        # subprocess, so the module stays importable, but its process-starting function is replaced and the
        # module cannot be loaded afresh
        import _posixsubprocess

        def fork_exec(*_args, **_kwargs):
            deny("starting processes is not allowed (subprocess)")

        _posixsubprocess.fork_exec = fork_exec
    sys.addaudithook(hook)


def _run_code(code, repl_last_expr):
    """Run ``code`` as ``__main__``; a last bare expression is printed like in a notebook. Returns the exit code."""
    filename = "<python>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    module = types.ModuleType("__main__")
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    try:
        tree = ast.parse(code, filename)
        last = None
        if repl_last_expr and tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        body = compile(tree, filename, "exec")
        tail = compile(last, filename, "eval") if last is not None else None
    except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as exc:
        traceback.print_exception(type(exc), exc, None)
        return 1
    try:
        exec(body, module.__dict__)
        if tail is not None:
            value = eval(tail, module.__dict__)
            if value is not None:
                print(repr(value))
    except SystemExit as exc:
        code_ = exc.code
        if code_ is None or isinstance(code_, int):
            return code_ or 0
        print(code_, file=sys.stderr)
        return 1
    except BaseException as exc:  # noqa: BLE001 - report like the interpreter would, without this frame
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None)
        return 1
    return 0


def _runner(cfg, status_fd, use_ns, mapped_nobody, libc):
    layers, notes = [], []
    scratch = cfg["scratch"]
    root_caller = cfg["caller_uid"] == 0
    try:
        for p in cfg.get("site_dirs", []):  # before any rerouting below
            if p not in sys.path:
                sys.path.append(p)
        if use_ns:
            layers += ["user_namespace", "net_namespace", "pid_namespace", "ipc_namespace"]
            drop_to_nobody = root_caller and mapped_nobody
            owner = (NOBODY, NOBODY) if drop_to_nobody else (os.getuid(), os.getgid())
            keep = _setup_namespace_mounts(libc, cfg, scratch, layers, notes, owner)
            os.chdir(scratch)
            if drop_to_nobody:
                _reroute_unreachable(keep)
                _become_nobody()
                layers.append("uid_nobody")
        else:
            os.setpgid(0, 0)
            keep = _interpreter_folders(cfg)
            if root_caller and cfg.get("drop_uid", True):
                os.chown(scratch, NOBODY, NOBODY)
                if _reroute_unreachable(keep):
                    notes.append("the interpreter's folders are closed to nobody: imported through "
                                 "/proc/self/fd (child interpreters cannot start)")
                _become_nobody()
                layers.append("uid_nobody")
        if libc is not None:
            try:
                libc.prctl(PR_SET_SECUREBITS, SECBITS_LOCK_ROOT)
            except OSError:
                pass  # needs CAP_SETPCAP: without it there is nothing left to lock
            try:
                libc.prctl(PR_SET_NO_NEW_PRIVS, 1)
                layers.append("no_new_privs")
            except OSError as exc:
                notes.append(f"no_new_privs not set ({exc})")
            try:
                libc.drop_capabilities()
                layers.append("no_capabilities")
            except OSError as exc:
                notes.append(f"capabilities not dropped ({exc})")
            try:
                libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
            except OSError:
                pass
        _set_rlimits(cfg["limits"], layers, notes)
        if cfg.get("audit", True):
            _install_audit_hook(scratch, cfg.get("allow_subprocess", False),
                                [cfg["caller_pid"], os.getppid()] if not use_ns else [],
                                read_ok=None if use_ns else keep)
            layers.append("audit_hook")
        _write_status(status_fd, stage="layers", layers=layers, notes=notes, uid=os.getuid())
    except BaseException as exc:  # noqa: BLE001 - a layer that must hold did not: run nothing
        try:
            _write_status(status_fd, stage="layers", layers=layers, notes=notes, failed=f"{type(exc).__name__}: {exc}")
        finally:
            os._exit(71)
    os.close(status_fd)
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    code = cfg.pop("code")
    repl = cfg.get("repl_last_expr", True)
    del cfg, libc
    rc = _run_code(code, repl)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a closed or full pipe: nothing more to say
        pass
    return rc


# --------------------------------------------------------------------------------------------------
# the supervisor
# --------------------------------------------------------------------------------------------------


def _children_of(pid):
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
                if int(stat[stat.rindex(b")") + 2:].split()[1]) == pid:
                    out.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _reap_all(child, use_ns):
    """Kill the runner and everything it started; as pid 1 of its namespace its death takes the rest along,
    in the fallback this process is the subreaper its orphans land on."""
    try:
        os.kill(child, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if not use_ns:
        try:
            os.killpg(child, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            while True:
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
        except ChildProcessError:
            return True  # no child left at all
        for pid in ([] if use_ns else _children_of(os.getpid())):  # orphans that left the process group
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    return False


def _wait(child, timeout_s):
    """(status, timed_out): the runner's wait status, waiting at most ``timeout_s`` seconds of wall clock."""
    deadline = time.monotonic() + timeout_s
    pidfd = None
    try:
        pidfd = os.pidfd_open(child)
    except (AttributeError, OSError):
        pass
    try:
        while True:
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid == child:
                return status, False
            left = deadline - time.monotonic()
            if left <= 0:
                return None, True
            if pidfd is not None:
                select.select([pidfd], [], [], left)
            else:
                time.sleep(min(left, 0.01))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def main():
    status_fd = int(sys.argv[2])
    cfg = _read_line()
    libc = None
    try:
        libc = _Libc()
    except OSError:
        pass
    use_ns = False
    ns_error = None
    if cfg.get("namespaces") and libc is not None:
        try:
            libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS)
            use_ns = True
        except OSError as exc:
            ns_error = str(exc)
    _write_status(status_fd, stage="ready", namespaces=use_ns, pid=os.getpid(), error=ns_error)
    go = _read_line()
    if not go.get("go"):
        os._exit(0)
    if not use_ns and libc is not None:
        try:
            libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        try:
            rc = _runner(cfg, status_fd, use_ns, bool(go.get("mapped_nobody")), libc)
        except BaseException:  # noqa: BLE001
            rc = 70
        os._exit(rc if isinstance(rc, int) and 0 <= rc < 256 else 1)
    _write_status(status_fd, stage="started", child=child)
    status, timed_out = _wait(child, float(cfg["limits"]["timeout_s"]))
    if status is None:
        _reap_all(child, use_ns)
        exit_code, sig = None, signal.SIGKILL
    else:
        exit_code = os.waitstatus_to_exitcode(status)
        sig = -exit_code if exit_code < 0 else None
        exit_code = None if exit_code < 0 else exit_code
        _reap_all(child, use_ns)
    _write_status(status_fd, stage="done", exit_code=exit_code, signal=sig, timed_out=timed_out)
    os._exit(0)


if __name__ == "__main__":
    main()
