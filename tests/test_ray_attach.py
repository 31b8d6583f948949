"""Attaching to a Ray cluster, or saying why not, within a bound (stare.eval.ray_attach; issue 54, item 5).

A real head runs here (``ray start --head`` with a temp dir of its own). A driver that cannot see that temp dir's
``session_*/sockets`` (docs/openrlhf-backend.md's second container on the head's host) is made by running it in a
mount namespace with an empty tmpfs over the temp dir (``unshare -m``, or inside a user namespace where this
machine allows only that; failing both, the sockets folder is renamed for the moment). Without the probe, Ray
2.55's ``ray.init`` in such a driver dies about 10 s later with a native ``raylet_ipc_client.cc`` stack trace, or,
when the driver cannot see the node's processes either (its own PID namespace, as in Docker), waits 60 s and raises
a traceback; and a head started by ``ray.init`` whose workers never register waits in ``ray.init`` for ever.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed: nothing to attach to")
import psutil  # noqa: E402 - a dependency of Ray

from stare.eval import ray_attach  # noqa: E402

BOUND_S = 20  # STARE_RAY_TIMEOUT_S in these tests; every failure here must come well within it
TRACE_MARKS = ("StackTrace", "Traceback", ".cc:", "_raylet.so")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_processes_of(temp_dir: str) -> None:
    """End the head's processes (every process whose command line names its temp dir, and their children), by id:
    ``ray stop`` would end every Ray on this machine, other tests' too."""
    procs, mine = [], {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    for p in psutil.process_iter(["cmdline"]):
        if p.pid not in mine and any(temp_dir in arg for arg in p.info["cmdline"] or ()):
            try:
                procs += [p, *p.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=3)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(scope="module")
def head():
    """A one-CPU Ray head with its own temp dir (short: Unix socket paths are limited to 107 bytes) and ports."""
    temp_dir = tempfile.mkdtemp(prefix="stare-ray-", dir="/tmp")
    port = free_port()
    try:
        res = subprocess.run(
            ["ray", "start", "--head", f"--temp-dir={temp_dir}", f"--port={port}", "--num-cpus=1",
             "--include-dashboard=false", "--disable-usage-stats", f"--ray-client-server-port={free_port()}",
             f"--dashboard-agent-listen-port={free_port()}"],
            capture_output=True, text=True, timeout=180)
        assert res.returncode == 0, res.stderr[-3000:]
        yield {"address": f"127.0.0.1:{port}", "temp_dir": temp_dir}
    finally:
        end_processes_of(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


MOUNT_EMPTY = ["sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"']  # then: the folder, the command


def namespace_prefix(folder: str, extra: tuple = ()) -> list[str] | None:
    """``unshare`` arguments for a mount namespace (plus ``extra`` namespaces) in which an empty tmpfs can be
    mounted over ``folder``, or None where neither root nor a user namespace can make one here."""
    if shutil.which("unshare") is None:
        return None
    for base in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
        argv = [*base, *extra]
        try:
            if subprocess.run([*argv, *MOUNT_EMPTY, folder, "true"], capture_output=True, timeout=30).returncode == 0:
                return argv
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


@contextmanager
def blind_to(temp_dir: str, argv: list[str], *, pids: bool = False):
    """``argv`` to run as a driver that cannot see ``temp_dir``'s sockets: in a mount namespace with an empty tmpfs
    over it (``pids``: in a PID namespace of its own too, seeing none of the head's processes, as in a second Docker
    container); without namespaces, the session's sockets folder renamed meanwhile (``pids`` then skips)."""
    prefix = namespace_prefix(temp_dir, ("--pid", "--fork", "--mount-proc") if pids else ())
    if prefix is not None:
        yield [*prefix, *MOUNT_EMPTY, temp_dir, *argv]
        return
    if pids:
        pytest.skip("no PID and mount namespace can be made here (unshare as root or in a user namespace)")
    sockets = Path(temp_dir, "session_latest", "sockets").resolve()
    hidden = sockets.with_name("sockets-hidden")
    sockets.rename(hidden)
    try:
        yield list(argv)
    finally:
        hidden.rename(sockets)


def run(argv, *, cwd, env_extra=None, timeout=120):
    env = {**os.environ, ray_attach.TIMEOUT_ENV: str(BOUND_S), **(env_extra or {})}
    env.pop("RAY_ADDRESS", None)
    start = time.monotonic()
    res = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)
    return res, time.monotonic() - start


def stare(*args) -> list[str]:
    return [sys.executable, "-c", "from stare.cli.main import main; main()", *args]


def one_line(res) -> str:
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, res.stderr[-3000:]
    assert not any(mark in res.stdout + res.stderr for mark in TRACE_MARKS), res.stderr[-3000:]
    return lines[0]


def test_train_without_the_raylet_socket_is_one_line_in_seconds(head, tmp_path):
    """`stare train --ray-address` from a driver that sees the cluster's GCS but not its node's sockets."""
    address, temp_dir = head["address"], head["temp_dir"]
    with blind_to(temp_dir, stare("train", "--preset", "qwen-7b-short-cot", "--ray-address", address, "--out",
                                  "run")) as argv:
        res, took = run(argv, cwd=tmp_path)
    line = one_line(res)
    print(f"stare train: the error line after {took:.1f} s")
    assert res.returncode == 2 and took < BOUND_S, (res.returncode, took)
    assert line.startswith(f"error: the Ray cluster at {address} answers, but this process cannot reach its "
                           f"node's raylet socket under {temp_dir}/session_"), line
    assert "docker exec into the head container, or ray job submit" in line and "docs/openrlhf-backend.md" in line
    assert not (tmp_path / "run").exists()


def test_eval_outside_the_nodes_containers_is_one_line_in_seconds(head, tmp_path):
    """`stare eval --ray-address` from a driver that sees neither the node's sockets nor its processes (a second
    Docker container: PID and mount namespaces of its own)."""
    address, temp_dir = head["address"], head["temp_dir"]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with blind_to(temp_dir, stare("eval", "--bench", "aime25", "--model", str(model), "--backend", "hf",
                                  "--ray-address", address, "--out", str(tmp_path / "ev")), pids=True) as argv:
        res, took = run(argv, cwd=tmp_path)
    line = one_line(res)
    print(f"stare eval: the error line after {took:.1f} s")
    assert res.returncode == 1 and took < BOUND_S, (res.returncode, took)
    assert line.startswith(f"error: the Ray cluster at {address} answers, but none of its 1 node(s) runs where "
                           "this process can see it"), line
    assert "docker exec into the head container, or ray job submit" in line


PROBE_WITHOUT_NODE_CHECK = """
import sys
from stare.eval import ray_attach
ray_attach._node_check = lambda address: True  # as with a Ray whose internals the check does not know
sys.exit(ray_attach._probe(sys.argv[1]))
"""


def test_the_native_crash_itself_is_read_as_one_line(head, tmp_path):
    """Where the GCS check cannot run (another Ray), the probe's ray.init meets the raylet socket missing for real:
    the child dies with Ray's native stack trace, and what the user gets from it is the same one line."""
    address, temp_dir = head["address"], head["temp_dir"]
    with blind_to(temp_dir, [sys.executable, "-c", PROBE_WITHOUT_NODE_CHECK, address]) as argv:
        # two tries at the raylet socket, not Ray's ten (a second apart): the same crash, 8 s sooner
        res, took = run(argv, cwd=tmp_path, env_extra={"RAY_raylet_client_num_connect_attempts": "2"})
    assert res.returncode != 0 and "raylet_ipc_client" in res.stderr, res.stderr[-3000:]  # the real crash
    line = ray_attach._cause(address, ray_attach._steps(res.stdout), res.stderr, res.returncode)
    assert line.startswith(f"the Ray cluster at {address} answers, but this process cannot reach its node's raylet "
                           f"socket under {temp_dir}/session_"), line
    assert "\n" not in line and took < BOUND_S


ATTACH = """
import json, sys
from stare.eval.engines import start_ray
ray, own = start_ray(sys.argv[1], 1)
print(json.dumps({"own": own, "cpus": ray.cluster_resources().get("CPU"),
                  "temp_dir": ray._private.worker._global_node.get_temp_dir_path()}))
ray.shutdown()
"""


def test_a_driver_that_sees_the_sockets_attaches(head, tmp_path):
    from stare.cli.openrlhf_backend import launch as orl

    address, temp_dir = head["address"], head["temp_dir"]
    res, took = run([sys.executable, "-c", ATTACH, address], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"own": True, "cpus": 1.0, "temp_dir": temp_dir}  # this head, not another Ray of this machine
    print(f"start_ray attached (probe, ray.init, first task) in {took:.1f} s")
    orl.check_ray_address(address)  # stare train's check: no error


SLOW_WORKERS = """
import time
with open("/proc/self/cmdline", "rb") as f:
    if b"default_worker.py" in f.read():  # a Ray worker process: hangs at its start, never registers
        time.sleep(30)
"""

START_LOCAL = """
from stare.eval.engines import EngineError, start_ray
try:
    start_ray(None, 1)
except EngineError as exc:
    print(exc)
else:
    print("started")
"""


def test_a_local_head_whose_workers_never_register_is_one_line(tmp_path):
    """A head started by ``ray.init`` (``stare eval --engines N``) on a machine where no worker registers: Ray kills
    each after its registration timeout (2 s here) and starts another; the start ends after the bound."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_WORKERS)
    bound = 4
    res, took = run([sys.executable, "-c", START_LOCAL], cwd=tmp_path, timeout=120,
                    env_extra={"PYTHONPATH": str(tmp_path / "site"), "RAY_worker_register_timeout_seconds": "2",
                               ray_attach.TIMEOUT_ENV: str(bound)})
    assert res.returncode == 0, res.stderr[-3000:]
    line = res.stdout.strip().splitlines()[-1]
    print(f"local head without workers: the error line after {took:.1f} s (bound {bound} s, ray.init included)")
    assert line.startswith(f"the Ray started here for the engines: no Ray worker process started and registered "
                           f"within {bound} s"), line
    assert f"raise {ray_attach.TIMEOUT_ENV}" in line and "/logs" in line


def test_a_port_that_never_answers_ends_at_the_bound():
    """A TCP port that accepts and stays silent (not a Ray GCS, or a GCS that hangs): Ray's own ray.init retries
    for good (`stare eval --ray-address` at such a port was still waiting after 2 minutes)."""
    bound = 4
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        ray_attach.check_reachable(address)  # the port opens
        start = time.monotonic()
        with pytest.raises(ray_attach.RayAttachError) as err:
            ray_attach.check_attach(address, environ={**os.environ, ray_attach.TIMEOUT_ENV: str(bound)})
        took = time.monotonic() - start
    print(f"silent port: the error after {took:.1f} s (bound {bound} s)")
    assert bound <= took < bound + 5, took
    assert str(err.value).startswith(f"the Ray cluster at {address} did not let this process attach within {bound} s "
                                     "(nothing at that port answered as Ray's GCS in time"), err.value


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_a_bad_bound_is_one_line(value):
    with pytest.raises(ray_attach.RayAttachError) as err:
        ray_attach.timeout_s({ray_attach.TIMEOUT_ENV: value})
    assert str(err.value) == (f"{ray_attach.TIMEOUT_ENV}={value!r}: expected a number of seconds > 0 (default "
                              f"{ray_attach.TIMEOUT_S:g})")
    assert ray_attach.timeout_s({}) == ray_attach.TIMEOUT_S
    assert ray_attach.timeout_s({ray_attach.TIMEOUT_ENV: "7.5"}) == 7.5
