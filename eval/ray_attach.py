"""Attach to a Ray cluster, or start one here, within a bound; otherwise one line that says why.

``stare train --ray-address`` (``stare.cli.openrlhf_backend.launch``) and ``stare eval --ray-address``
(``stare.eval.engines.start_ray``) use it; ``stare run --ray-address`` runs both. Standard library only at import: the
CLI imports it before it knows whether Ray is installed.

Why a probe. Ray 2.55's ``ray.init(address=HOST:PORT)`` talks to the cluster's GCS over TCP, then to the raylet of
*its own node* through Unix sockets under that node's ``<temp-dir>/session_*/sockets/``, a folder found by looking
for raylet processes in the local process table. A driver that cannot see that folder (a second Docker container on
the head's host, another mount namespace) connects to the GCS, then dies about 10 s later with a native
``raylet_ipc_client.cc: Failed to connect to socket`` and a C++ stack trace; one that sees no raylet at all (its own
PID namespace, or a host outside the cluster) waits 60 s and raises. Neither can be caught in the process that
calls ``ray.init``, so ``check_attach`` first attaches in a child process (``python -m stare.eval.ray_attach
ADDRESS``) under a deadline (``timeout_s``: ``TIMEOUT_S``, or ``STARE_RAY_TIMEOUT_S``). The child first reads
from the GCS the node it would attach through, as Ray does, and checks that the node's raylet and object store
sockets exist here; then it runs ``ray.init`` itself and disconnects. Whatever goes wrong is one line naming the
address and the cause; the child's own output (a C++ stack trace included) is never shown.

Why a first task. A Ray whose worker processes never register with the raylet (a loaded machine: Ray kills a
worker that has not registered in 60 s, counts it as "failed pending registration" and starts another, with no end)
was seen to wait 7 minutes. For a head started by ``ray.init`` the wait is inside ``ray.init`` itself: the raylet
answers the first driver only once the workers it prestarts for it have registered. So a head started here gets
``LOCAL_HEAD_CONFIG`` (no such prestart: ``ray.init`` returns), and ``check_workers`` runs one empty task right
after ``ray.init`` and gives up after the same bound.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from urllib.parse import urlparse

TIMEOUT_S = 60.0  # the probe's deadline, and the first task's: well above a healthy attach (a few seconds)
TIMEOUT_ENV = "STARE_RAY_TIMEOUT_S"
DOC = "docs/openrlhf-backend.md"
# ray.init's ``_system_config`` for a head started in this process: by default the raylet answers the first driver's
# registration only once the workers it prestarts for it have registered, so ``ray.init`` itself waits for workers
# that may never come; without the prestart it returns, and ``check_workers`` bounds the wait
LOCAL_HEAD_CONFIG = {"prestart_worker_first_driver": False}
ON_THE_HEAD = ("run the driver on the head node itself (docker exec into the head container, or ray job submit); "
               f"see {DOC}")


class RayAttachError(RuntimeError):
    """This process cannot attach to the Ray cluster (or start one): one line, the address and the cause."""


def timeout_s(environ=None) -> float:
    """The bound in seconds: ``STARE_RAY_TIMEOUT_S`` when set, else ``TIMEOUT_S``."""
    environ = os.environ if environ is None else environ
    value = environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise RayAttachError(f"{TIMEOUT_ENV}={value!r}: expected a number of seconds > 0 (default {TIMEOUT_S:g})")
    return seconds


def host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of HOST:PORT or ray://HOST:PORT; None for ``auto`` or when it is not of that form."""
    if address == "auto":
        return None
    url = urlparse(address if "://" in address else f"ray://{address}")
    try:
        port = url.port
    except ValueError:
        return None
    return (url.hostname, port) if url.hostname and port else None


def check_reachable(address: str, timeout: float = 3.0) -> None:
    """The address's TCP port opens (``auto`` is left to the probe); ``RayAttachError`` otherwise."""
    where = host_port(address)
    if where is None:
        if address == "auto":
            return
        raise RayAttachError(f"--ray-address {address!r} is not HOST:PORT (e.g. 10.0.0.1:6379, ray://head:10001, "
                             "auto)")
    try:
        with socket.create_connection(where, timeout=timeout):
            pass
    except OSError as exc:
        raise RayAttachError(f"cannot reach the Ray cluster at {address!r} ({exc.strerror or exc}); start it with "
                             "`ray start --head` on the head node, or leave --ray-address out to start one here"
                             ) from None


def check_attach(address: str, *, timeout: float | None = None, environ=None) -> float:
    """Attach to ``address`` in a child process within ``timeout`` seconds (default ``timeout_s()``); returns the
    seconds it took, or raises ``RayAttachError`` with the cause (module docstring)."""
    bound = timeout_s(environ) if timeout is None else timeout
    start = time.monotonic()
    child = subprocess.Popen([sys.executable, "-m", __name__, address], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             env=None if environ is None else dict(environ))
    try:
        out, err = child.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        _kill_group(child)
        out, err = child.communicate()
        steps = _steps(out)
        raise RayAttachError(f"the Ray cluster at {address} did not let this process attach within {bound:g} s "
                             f"({_stage(steps)}); check `ray status` on the head node, or {ON_THE_HEAD} "
                             f"({TIMEOUT_ENV} sets the bound)") from None
    steps = _steps(out)
    if child.returncode == 0 and steps and steps[-1].get("ok"):
        return time.monotonic() - start
    raise RayAttachError(_cause(address, steps, err, child.returncode))


def check_workers(ray, where: str, *, timeout: float | None = None, logs: str | None = None) -> None:
    """Run one empty task on the Ray this process is attached to (``where`` names it in the error): ``RayAttachError``
    when no worker runs it within ``timeout`` seconds (default ``timeout_s()``) or it fails."""
    from ray.exceptions import GetTimeoutError

    bound = timeout_s() if timeout is None else timeout
    ref = ray.remote(num_cpus=0)(_worker_pid).remote()
    try:
        ray.get(ref, timeout=bound)
    except GetTimeoutError:
        see = f"its logs are in {logs}; " if logs else ""
        raise RayAttachError(f"{where}: no Ray worker process started and registered within {bound:g} s (the "
                             "raylet's log then says its workers 'have not registered within the timeout': a machine "
                             f"too loaded to start them, or a worker that hangs at start); {see}free CPU or memory, "
                             f"or raise {TIMEOUT_ENV}") from None
    except Exception as exc:  # e.g. the runtime environment or the setup hook failed in the worker
        raise RayAttachError(f"{where}: a Ray worker failed at its start: {_last_line(str(exc))}") from None


def session_logs(ray) -> str | None:
    """The logs folder of the Ray session this process started or attached to (None when Ray does not say)."""
    try:
        return os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    except Exception:
        return None


def _worker_pid() -> int:
    return os.getpid()


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        child.kill()


def _steps(out: str) -> list[dict]:
    steps = []
    for line in (out or "").splitlines():
        try:
            step = json.loads(line)
        except ValueError:
            continue
        if isinstance(step, dict):
            steps.append(step)
    return steps


def _stage(steps: list[dict]) -> str:
    """Where a probe that ran out of time was."""
    done = {s.get("step") for s in steps}
    if "init" in done:
        return "ray.init did not return: the node's raylet may be waiting for workers that do not register"
    if "node" in done:
        return "the GCS answered, ray.init did not return"
    if "import" in done:
        return "nothing at that port answered as Ray's GCS in time: is it the head's --port?"
    return "Ray did not even import in time: is this machine overloaded?"


FATAL_LINE = re.compile(r"^\[[^\]]* C \d+ \d+\] (\S+:\d+: .*)$")  # a Ray RAY_CHECK / fatal log line
SOCKET_LINE = re.compile(r"Failed to connect to socket at address:\s*(\S+)")


def _cause(address: str, steps: list[dict], err: str, returncode: int) -> str:
    """The one line for a probe that ended without attaching."""
    for step in steps:
        if step.get("cause") == "no-node":
            return (f"the Ray cluster at {address} answers, but none of its {step['nodes']} node(s) runs where this "
                    "process can see it (no raylet of the cluster among this machine's or container's processes; a "
                    f"driver must run on a node of the cluster): {ON_THE_HEAD}")
        if step.get("cause") == "socket":
            return (f"the Ray cluster at {address} answers, but this process cannot reach its node's "
                    f"{step['what']} socket under {os.path.dirname(step['path'])}: {ON_THE_HEAD}")
        if "error" in step:
            return f"cannot attach to the Ray cluster at {address}: {step['error']}"
    found = SOCKET_LINE.search(err or "")
    if found:
        return (f"the Ray cluster at {address} answers, but this process cannot reach its node's raylet socket "
                f"under {os.path.dirname(found.group(1))}: {ON_THE_HEAD}")
    fatal = [m.group(1) for m in map(FATAL_LINE.match, (err or "").splitlines()) if m]
    why = fatal[0] if fatal else _last_line(err) or f"exit status {returncode}"
    if returncode < 0:
        why = f"{why} (signal {-returncode})"
    return f"cannot attach to the Ray cluster at {address}: the attaching process died: {why}"


def _last_line(text: str) -> str:
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    return lines[-1] if lines else ""


# ---- the child: python -m stare.eval.ray_attach ADDRESS ------------------------------------------------------------

def _say(**step) -> None:
    print(json.dumps(step), flush=True)


def _node_check(address: str) -> bool:
    """What the GCS says about the node ``ray.init`` would attach through (as Ray 2.55 picks it: a raylet of the
    cluster found among this machine's processes, the head first), and whether its sockets are there from here.
    False (and the cause said) when they are not; True when fine or when this Ray has other internals."""
    try:
        from ray._private.services import canonicalize_bootstrap_address, find_node_ids
        from ray._raylet import GcsClient
        from ray.core.generated.gcs_pb2 import GcsNodeInfo
    except ImportError:  # another Ray than the one this was written against: ray.init alone decides
        return True
    gcs_address = canonicalize_bootstrap_address(address)
    if gcs_address is None:
        return True
    nodes = list(GcsClient(address=gcs_address).get_all_node_info(
        timeout=10, state_filter=GcsNodeInfo.GcsNodeState.ALIVE).values())
    _say(step="node", nodes=len(nodes))
    here = set(find_node_ids())
    mine = sorted((n for n in nodes if n.node_id.hex() in here), key=lambda n: not n.is_head_node)
    if not mine:
        _say(cause="no-node", nodes=len(nodes))
        return False
    node = mine[0]
    for what, path in (("raylet", node.raylet_socket_name), ("object store", node.object_store_socket_name)):
        try:
            is_socket = stat.S_ISSOCK(os.stat(path).st_mode)
        except OSError:
            is_socket = False
        if not is_socket:
            _say(cause="socket", what=what, path=path)
            return False
    return True


def _probe(address: str) -> int:
    import logging

    import ray

    _say(step="import")
    try:
        if not address.startswith("ray://") and not _node_check(address):
            return 1
    except Exception as exc:  # e.g. "auto" and no Ray here, or a GCS that refuses the node table
        _say(error=_last_line(str(exc)) or type(exc).__name__)
        return 1
    _say(step="init")
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    except Exception as exc:
        _say(error=_last_line(str(exc)) or type(exc).__name__)
        return 1
    ray.shutdown()
    _say(ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(_probe(sys.argv[1]))
