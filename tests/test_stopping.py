"""Stopping a command: SIGINT (Ctrl-C) and SIGTERM end every process of `stare run`, `stare train` and `stare eval`
within seconds (checked by PID), leave what finished, and `--resume` then gives the uninterrupted result; a second
Ctrl-C kills at once; a worker outlives no parent. All with real processes and signals."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tiny_models import PROBLEMS, build_tiny_model, write_problems

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; parent-death is Linux's")

FAST = ["warmstart_steps=100", "warmstart_noise=0.3", "eval_problems=8", "prompts_per_step=4", "samples_per_prompt=4",
        "train_problems=200", "micro_batch_size=8", "seeds=1"]


def sets(*extra):
    return sum((["--set", s] for s in [*FAST, *extra]), [])


def stare_cmd(*args):
    return [sys.executable, "-m", "stare.cli.main", *map(str, args)]


def start(cmd, **kw):
    """A process in a session of its own: its session id is its PID, shared by everything it starts."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kw)


def session_pids(sid: int) -> set[int]:
    """The live (not zombie) processes of session ``sid``, from /proc."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, session, ...
        if int(fields[3]) == sid and fields[0] != "Z":
            out.add(int(entry.name))
    return out


def alive(pids) -> set[int]:
    left = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if state[state.rindex(")") + 2] != "Z":
            left.add(pid)
    return left


def wait_until(predicate, timeout=120.0, proc=None, what="the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended (exit {proc.returncode}) before {what}: "
                                 f"{proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def signal_and_measure(proc, sig, *, group=False):
    """Send ``sig`` (to the process, or its whole group as a terminal's Ctrl-C does); returns (exit code, seconds
    until every process of its session had ended, stderr)."""
    pids = session_pids(proc.pid)
    assert proc.pid in pids
    t0 = time.monotonic()
    (os.killpg if group else os.kill)(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    wait_until(lambda: not alive(pids), timeout=30, what="every process of the session to end")
    return proc.returncode, time.monotonic() - t0, err, pids


def workers(sid: int) -> set[int]:
    """The session's spawned worker processes (a process that ends while this reads /proc is skipped)."""
    out = set()
    for p in session_pids(sid):
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmdline:
            out.add(p)
    return out


def metric_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


# How long a stopped `stare run` may take to end every process of its session. Stopping takes the workers' grace
# (stopping.GRACE_S, 10 s) at most plus the parent's own exit, under 15 s on a quiet 2-core machine; a clean-clone CI
# run measured 38 s for SIGTERM while the other pytest worker's vLLM engines held both cores. The bound says "stopped,
# not finished": the rest of the training would take longer, and the tests below also check that it did not finish.
RUN_STOP_S = 60


def test_stare_run_stops_on_ctrl_c_sigterm_and_kill_then_resumes_to_the_uninterrupted_table(tmp_path):
    args = ["run", "--preset", "tiny-cpu", "--algos", "grpo,stare", *sets("steps=24", "save_every=3")]
    straight = tmp_path / "a" / "r"
    res = subprocess.run(stare_cmd(*args, "--out", straight), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "b" / "r"
    cmd = stare_cmd(*args, "--out", out)

    # 1. Ctrl-C (SIGINT to the whole process group) during the warm starts: the workers ignore it, the parent stops
    #    them; exit 130, one line with the exact resume command; nothing queued starts
    proc = start(cmd)
    wait_until(lambda: workers(proc.pid), proc=proc, what="the warm start's worker")  # one seed: one warm start
    rc, seconds, err, pids = signal_and_measure(proc, signal.SIGINT, group=True)
    assert rc == 130, err[-3000:]
    assert seconds < RUN_STOP_S, seconds
    resume = ("stare run --preset tiny-cpu --algos grpo,stare " + " ".join(f"--set {s}" for s in
              [*FAST, "steps=24", "save_every=3"]) + f" --out {out} --resume")
    assert "stopped by SIGINT: 1 worker(s) stopped, 2 queued job(s) not started" in err and err.rstrip().endswith(f"Continue with: {resume}"), err
    assert not (out / "grpo" / "metrics.jsonl").exists() or metric_lines(out / "grpo" / "metrics.jsonl") == 0
    assert not (out / ".stare-lock").exists()

    # 2. SIGTERM to the parent alone, mid-training: exit 143, its workers end too (no orphan keeps training)
    proc = start([*cmd, "--resume"])
    wait_until(lambda: metric_lines(out / "grpo" / "metrics.jsonl") >= 7, proc=proc, what="grpo's 7th step")
    rc, seconds, err, pids = signal_and_measure(proc, signal.SIGTERM)
    assert rc == 143 and "stopped by SIGTERM" in err, err[-3000:]
    assert seconds < RUN_STOP_S, seconds
    stopped_at = metric_lines(out / "grpo" / "metrics.jsonl")
    assert 7 <= stopped_at < 24 and not (out / "grpo" / "eval.json").exists()
    assert (out / "grpo" / "checkpoint" / "trainer_state.pt").is_file()  # the last whole checkpoint, none cut
    assert not (out / "grpo" / "checkpoint.old").exists() and not (out / "grpo" / "checkpoint.tmp").exists()

    # 3. SIGKILL to the parent (no chance to clean up): the kernel stops its workers (parent-death signal); its lock
    #    is left behind, and the next run takes it over with a warning
    proc = start([*cmd, "--resume"])
    wait_until(lambda: len(workers(proc.pid)) == 2 and metric_lines(out / "stare" / "metrics.jsonl") >= 1, proc=proc,
               what="both arms training")
    rc, seconds, err, pids = signal_and_measure(proc, signal.SIGKILL)
    assert rc == -signal.SIGKILL and seconds < RUN_STOP_S, (rc, seconds)
    lock = json.loads((out / ".stare-lock").read_text())
    assert lock["pid"] == proc.pid

    res = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"took over the lock of PID {proc.pid}" in res.stderr
    assert (out / "comparison.csv").read_text() == (straight / "comparison.csv").read_text()
    for arm in ("grpo", "stare"):
        a = [{k: v for k, v in json.loads(ln).items() if k != "time_s"}
             for ln in (straight / arm / "metrics.jsonl").read_text().splitlines()]
        b = [{k: v for k, v in json.loads(ln).items() if k != "time_s"}
             for ln in (out / arm / "metrics.jsonl").read_text().splitlines()]
        assert a == b, arm
    assert not (out / ".stare-lock").exists()


SECOND_SIGNAL = """
import subprocess, sys, time
from stare.cli import stopping
stopping.GRACE_S = 120.0
with stopping.stop_on_signals():
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"], stdout=subprocess.PIPE,
                             text=True)
    child.stdout.readline()
    stopping.track(child)
    try:
        print(child.pid, flush=True)  # inside the try: the test's SIGINT, sent on reading it, lands here
        while True:
            time.sleep(0.05)
    except KeyboardInterrupt:
        print("stopping", flush=True)
        stopping.report("one child")
        stopping.stop_processes([child])  # the child ignores SIGTERM: this waits out the grace period
        raise
"""


def test_a_second_ctrl_c_kills_at_once(tmp_path):
    proc = start([sys.executable, "-c", SECOND_SIGNAL])
    child = int(proc.stdout.readline())
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "stopping"
    time.sleep(0.5)
    assert proc.poll() is None and alive([child])  # the first stop waits for the child (which ignores SIGTERM)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=10)
    assert proc.returncode == 130 and time.monotonic() - t0 < 5
    wait_until(lambda: not alive([child]), timeout=5, what="the child killed")


def test_stop_processes_kills_what_ignores_sigterm_after_the_grace_period():
    from stare.cli import stopping

    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"], stdout=subprocess.PIPE)
    polite = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True); import time; time.sleep(600)"],
                              stdout=subprocess.PIPE)
    child.stdout.readline(), polite.stdout.readline()
    t0 = time.monotonic()
    assert stopping.stop_processes([child, polite], grace=1.0) == 2
    took = time.monotonic() - t0
    assert child.returncode == -signal.SIGKILL and polite.returncode == -signal.SIGTERM
    assert 1.0 <= took < 4, took


CRITICAL = """
import sys, time
from pathlib import Path
from stare.cli import stopping
mark = Path(sys.argv[1])
with stopping.stop_on_signals():
    with stopping.critical():
        print("in", flush=True)
        time.sleep(1.0)
        mark.write_text("whole")
    time.sleep(60)
    mark.write_text("after the block: never")
"""


@pytest.mark.parametrize("worker", [False, True])
def test_a_stop_waits_for_the_critical_block(tmp_path, worker):
    mark = tmp_path / "mark"
    script = CRITICAL.replace("with stopping.stop_on_signals():",
                              "stopping.worker_setup()\nif True:") if worker else CRITICAL
    proc = start([sys.executable, "-c", script, str(mark)])
    assert proc.stdout.readline().strip() == "in"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    assert proc.returncode == 143
    assert mark.read_text() == "whole"  # the block finished, and nothing after it ran
    if not worker:
        assert "stopped by SIGTERM: nothing was running" in proc.stderr.read()


STARTING_WORKER = """
import multiprocessing as mp, os, signal, sys, time
from concurrent.futures import ProcessPoolExecutor
from stare.cli import stopping

def job():
    return os.getpid()

if __name__ == "__main__":
    pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=stopping.worker_setup,
                               initargs=(os.getpid(),))
    with stopping.stop_on_signals():
        try:
            fut = stopping.submit(pool, job)
            os.killpg(0, signal.SIGINT)  # Ctrl-C while the worker's interpreter is still starting
            time.sleep(30)
        except KeyboardInterrupt:
            print("parent stopped", flush=True)
            print("worker ran", fut.result(timeout=60) > 0, flush=True)  # a dead worker: BrokenProcessPool
            pool.shutdown()
            raise
"""


def test_a_ctrl_c_while_a_worker_starts_does_not_kill_it_half_started(tmp_path):
    # the CI failure this guards: SIGINT reached a spawned worker during its imports, before worker_setup ignored it
    script = tmp_path / "starting.py"
    script.write_text(STARTING_WORKER)
    for _ in range(3):
        proc = start([sys.executable, str(script)])
        out, err = proc.communicate(timeout=120)
        assert out.splitlines() == ["parent stopped", "worker ran True"], err[-3000:]
        assert "Traceback" not in err and "Fatal Python error" not in err, err[-3000:]
        assert proc.returncode == 130


MID_LAUNCH = """
import multiprocessing as mp, os, signal, sys, threading, time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import popen_spawn_posix
from stare.cli import stopping

def job():
    time.sleep(600)

def spawn_then_signal(path, args, passfds):  # the child exists, its start-up data not yet written down its pipe
    pid = real_spawn(path, args, passfds)
    if not any("spawn_main" in str(a) for a in args):  # the resource tracker's start, not a worker's
        return pid
    os.kill(os.getpid(), signal.SIG)
    time.sleep(0.5)  # the handler's chance to run in the main thread
    return pid

if __name__ == "__main__":
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # a thread where SIGINT is not blocked
    real_spawn = popen_spawn_posix.util.spawnv_passfds
    popen_spawn_posix.util.spawnv_passfds = spawn_then_signal
    pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=stopping.worker_setup,
                               initargs=(os.getpid(),))
    with stopping.stop_on_signals():
        try:
            stopping.submit(pool, job)
            print("not stopped", flush=True)
        except KeyboardInterrupt:
            time.sleep(3)  # a child cut off mid-start would have died by now
            print("stopped", stopping.stop_processes(list(pool._processes.values()), grace=20), flush=True)
            raise
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_while_the_parent_writes_a_workers_start_up_data_waits_for_it(tmp_path, sig):
    # the CI failure this guards: a Ctrl-C reached the parent (through another thread) between the worker's spawn and
    # the write of its start-up data; the stop cut the write, the worker died of EOFError and "0 worker(s) stopped"
    script = tmp_path / "mid_launch.py"
    script.write_text(MID_LAUNCH.replace("signal.SIG)", f"signal.{sig})"))
    proc = start([sys.executable, str(script)])
    out, err = proc.communicate(timeout=120)
    assert out.splitlines() == ["stopped 1"], (out, err[-3000:])
    assert "Traceback" not in err and "EOFError" not in err, err[-3000:]
    assert proc.returncode == (130 if sig == "SIGINT" else 143)
    assert f"stopped by {sig}" in err


QUEUED_JOBS = """
import multiprocessing as mp, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from stare.cli import stopping
from stare.cli.local import runner

def job(i):
    print("started", i, flush=True)
    time.sleep(600)

if __name__ == "__main__":
    pool = ProcessPoolExecutor(2, mp_context=mp.get_context("spawn"), initializer=stopping.worker_setup,
                               initargs=(os.getpid(),))
    jobs = runner.Jobs(pool, 2)
    for i in range(5):
        jobs.add(i, job, i)
    with stopping.stop_on_signals():
        try:
            while True:  # the run's loop: hand over what a free worker can take
                jobs.fill()
                time.sleep(0.05)
        except KeyboardInterrupt:
            runner._stop_pool(pool, jobs)
            pool.shutdown(wait=True)
            raise
"""


def test_a_stop_counts_the_jobs_not_started_and_prints_no_thread_traceback(tmp_path):
    """Five arms, two workers: a Ctrl-C stops the two running and says three never started, with no
    ``InvalidStateError`` from the pool's own thread (what cancelling a future the pool had not picked up printed)."""
    script = tmp_path / "queued.py"
    script.write_text(QUEUED_JOBS)
    proc = start([sys.executable, str(script)])
    started = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}
    assert started == {"started 0", "started 1"}
    time.sleep(1.0)  # the loop keeps calling fill(): nothing more may start while both workers are busy
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "started" not in out  # no third job ran, before or after the stop
    assert "stopped by SIGINT: 2 worker(s) stopped, 3 queued job(s) not started" in err, err[-3000:]
    assert "Traceback" not in err and "Exception in thread" not in err and "InvalidStateError" not in err, err


DIES_WITH_PARENT = """
import subprocess, sys, time
from stare.cli import stopping
child = subprocess.Popen([sys.executable, "-c", "from stare.cli.stopping import from_env; from_env(); "
                          "print('ready', flush=True); import time; time.sleep(600)"], env=stopping.child_env(),
                         stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_child_dies_with_its_parent():
    proc = start([sys.executable, "-c", DIES_WITH_PARENT])
    child = int(proc.stdout.readline())
    assert alive([child])
    proc.kill()
    proc.wait()
    wait_until(lambda: not alive([child]), timeout=10, what="the child to die with its parent")


SLOW_EVAL = """
import sys, time
from stare.eval import backends
batch = backends.HFBackend._batch
def slow_batch(self, *args, **kwargs):
    time.sleep(0.7)
    return batch(self, *args, **kwargs)
backends.HFBackend._batch = slow_batch
sys.argv = ["stare", *sys.argv[1:]]
from stare.cli.main import main
main()
"""


@pytest.fixture(scope="module")
def eval_case(tmp_path_factory):
    """A tiny trained model, five problems, and its uninterrupted evaluation."""
    tmp = tmp_path_factory.mktemp("eval")
    model = build_tiny_model(tmp / "model", train=True, steps=150)
    rows = PROBLEMS + [{"id": "p4", "problem": "What is 1+4?", "answer": "5"}]
    data = write_problems(tmp / "mini.jsonl", rows)
    args = ["eval", "--bench", "aime25", "--model", str(model), "--data-file", str(data), "--k", "2",
            "--max-tokens", "12", "--backend", "hf", "--seed", "3"]
    full = tmp / "full"
    res = subprocess.run(stare_cmd(*args, "--out", full), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return args, full, len(rows)


@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["sigterm", "ctrl-c"])
def test_stare_eval_stops_and_resumes_to_the_uninterrupted_summary(tmp_path, eval_case, sig, group):
    """SIGTERM to the process, or Ctrl-C to its whole group (the scoring workers with it): every process ends within
    seconds, the finished problems' samples stay, and --resume gives the uninterrupted summary."""
    args, full, n = eval_case
    out = tmp_path / "stopped"
    # HF batches of one problem each (two rows of under 40 tokens), so problems are written one after another
    proc = start([sys.executable, "-c", SLOW_EVAL, *args, "--out", str(out)],
                 env={**os.environ, "STARE_HF_BATCH_TOKENS": "80"})
    wait_until(lambda: (out / "samples.jsonl").exists() and (out / "samples.jsonl").read_text().count("\n") >= 2,
               proc=proc, what="the first problem's samples")
    rc, seconds, err, pids = signal_and_measure(proc, sig, group=group)
    name = signal.Signals(sig).name
    assert rc == 128 + sig and seconds < 10, (rc, seconds, err[-2000:])
    assert f"stopped by {name}: the evaluation in {out}" in err, err
    assert err.rstrip().endswith(f"--out {out} --resume"), err
    done = (out / "samples.jsonl").read_text().count("\n")
    assert 2 <= done < 2 * n and not (out / "summary.json").exists()
    assert not (out / ".stare-lock").exists()
    res = subprocess.run(stare_cmd(*args, "--out", out, "--resume"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]

    def scores(folder):
        s = json.loads((folder / "summary.json").read_text())
        return {k: s[k] for k in ("avg_at_k", "pass_at_k", "maj_at_k", "n_problems", "per_problem") if k in s}

    assert scores(out) == scores(full) and scores(full)["n_problems"] == n


CLUSTER = """
import sys
from pathlib import Path
from stare.cli import cluster_run as cr, stopping
from stare.cli.run_set import resolve_run_set
out = Path(sys.argv[1])
arm_set = resolve_run_set("qwen-7b-short-cot", [], algos="grpo,dapo", seeds=None)
plan = cr.plan_cluster_run(arm_set, out, preset_arg="qwen-7b-short-cot", sets=[],
                           evals=cr.EvalOptions(["aime25"], "stare"), ray_address=None, resume=False, parallel=1)
plan.parallel = 2  # both arms at once (a real --parallel 2 needs a Ray cluster's GPUs)
for step in plan.steps:  # a long local training stands in for each OpenRLHF job
    if step.kind == cr.TRAIN:
        step.command = ["train", "--preset", "tiny-cpu", "--algo", step.arm, "--out", str(step.run_dir / "local"),
                        *sys.argv[2:]]
with stopping.stop_on_signals():
    cr.run_cluster(plan, lambda line: print(line, flush=True))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_gpu_stare_runs_children_stop_with_it(tmp_path, sig):
    """stare run on a GPU preset starts each step as a child in its own process group: a stop reaches them from the
    parent (SIGTERM: each stare train stops as it would alone, and no evaluation starts); a parent killed outright
    takes them with it (their parent-death signal)."""
    out = tmp_path / "out"
    proc = start([sys.executable, "-c", CLUSTER, str(out), *sets("steps=400", "warmstart_steps=5")])
    metrics = [out / arm / "seed0" / "local" / "metrics.jsonl" for arm in ("grpo", "dapo")]
    wait_until(lambda: all(metric_lines(m) >= 1 for m in metrics), proc=proc, what="both trainings stepping")
    children = {int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(int(p.name)) == proc.pid}
    assert len(children) == 2
    groups = {os.getpgid(c) for c in children}
    assert groups == children  # each leads its own group: a terminal's Ctrl-C reaches only the parent
    procs = set().union(*(session_pids(c) for c in children)) | children
    proc.send_signal(sig)
    proc.communicate(timeout=120)
    wait_until(lambda: not alive(procs), timeout=30, what="every child process to end")
    if sig == signal.SIGTERM:
        assert proc.returncode == 143
        for arm in ("grpo", "dapo"):
            log = (out / "logs" / f"{arm}-seed0-train.log").read_text()
            assert "stopped by SIGTERM: the training in" in log, log[-2000:]
            assert not (out / "logs" / f"{arm}-seed0-eval-aime25.log").exists()  # nothing new started
    assert not any(m.with_name("eval.json").exists() for m in metrics)


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])
