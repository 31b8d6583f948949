"""One writer per folder (stare.cli.folder_lock): a second writer of a run or evaluation folder, or of a folder inside
one, is refused in one line (exit 2) with the holder's PID and host, and nothing there changes; a lock left by a
process that died is taken over with a warning; a parent's lock is its children's; readers take none."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stare.cli import folder_lock as fl
from stare.cli.main import app

runner = CliRunner()

FAST = ["warmstart_steps=20", "eval_problems=4", "prompts_per_step=2", "samples_per_prompt=2", "train_problems=50",
        "micro_batch_size=4", "eval_k=2", "steps=2"]

HOLD = """
import sys, time
from stare.cli.folder_lock import hold
with hold(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def stare(*args, **kw):
    return subprocess.run([sys.executable, "-m", "stare.cli.main", *map(str, args)], capture_output=True, text=True,
                          timeout=300, **kw)


def holder(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A finished local training run (seconds)."""
    out = tmp_path_factory.mktemp("lock") / "run"
    res = stare("train", "--preset", "tiny-cpu", "--algo", "grpo", "--out", out, *sum((["--set", s] for s in FAST), []))
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_every_second_writer_is_refused_in_one_line_and_nothing_changes(run_dir, tmp_path):
    proc = holder(run_dir)
    try:
        before = snapshot(run_dir)
        lock = json.loads((run_dir / fl.LOCK_NAME).read_text())
        assert lock["pid"] == proc.pid and lock["host"] == socket.gethostname()
        sets = sum((["--set", s] for s in FAST), [])
        for args in (["train", "--preset", "tiny-cpu", "--algo", "grpo", "--out", run_dir, "--resume", *sets],
                     ["run", "--preset", "tiny-cpu", "--algos", "grpo", "--out", run_dir, "--resume", *sets],
                     ["eval", "--bench", "aime25", "--out", run_dir, "--backend", "hf", "--limit", "1", "--k", "1"],
                     # a folder inside the locked one: a stare run's arm, an evaluation of the run
                     ["train", "--preset", "tiny-cpu", "--algo", "grpo", "--out", run_dir / "arm", *sets],
                     ["eval", "--bench", "aime25", "--model", run_dir / "final", "--out", run_dir / "eval-x",
                      "--backend", "hf", "--limit", "1", "--k", "1"]):
            res = runner.invoke(app, list(map(str, args)), terminal_width=200)  # in this process: seconds saved
            assert res.exit_code == 2, (args, res.stderr[-2000:], res.exception)
            lines = res.stderr.strip().splitlines()
            assert len(lines) == 1, res.stderr
            assert lines[0] == (f"error: {run_dir} is being written by PID {proc.pid} on {socket.gethostname()} "
                                f"(since {_since(lock)}: {lock['command']}); wait for it to finish or stop it "
                                f"(Ctrl-C, or kill {proc.pid}), then run again (nothing was changed)"), lines[0]
        assert snapshot(run_dir) == before
        # readers take no lock
        res = stare("compare", run_dir, "--out", tmp_path / "cmp")
        assert res.returncode == 0, res.stderr[-2000:]
        assert "grpo" in (tmp_path / "cmp" / "comparison.csv").read_text()
    finally:
        proc.kill()
        proc.wait()


def _since(lock: dict) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lock["started"]))


def test_a_stale_lock_is_taken_over_with_a_warning_and_released(tmp_path):
    folder = tmp_path / "f"
    proc = holder(folder)
    proc.send_signal(signal.SIGKILL)  # dies holding it: the file stays, the kernel's lock goes
    proc.wait()
    assert json.loads((folder / fl.LOCK_NAME).read_text())["pid"] == proc.pid
    warnings = []
    with fl.hold(folder, warn=warnings.append):
        assert json.loads((folder / fl.LOCK_NAME).read_text())["pid"] == os.getpid()
        with pytest.raises(fl.FolderLocked):  # another process sees this one's
            _check_free_in_child(folder / "inner")
    assert len(warnings) == 1 and f"took over the lock of PID {proc.pid} on {socket.gethostname()}" in warnings[0]
    assert not (folder / fl.LOCK_NAME).exists()


def _check_free_in_child(folder: Path, env=None) -> None:
    res = subprocess.run([sys.executable, "-c", "import sys\nfrom stare.cli.folder_lock import check_free\n"
                          "check_free(sys.argv[1])", str(folder)], capture_output=True, text=True, env=env)
    if res.returncode:
        assert "FolderLocked" in res.stderr, res.stderr
        raise fl.FolderLocked(res.stderr.strip().splitlines()[-1])


def test_a_parents_lock_is_its_childrens_and_a_folder_it_made_goes(tmp_path):
    folder = tmp_path / "new" / "run"
    with fl.hold(folder):
        assert folder.is_dir()
        _check_free_in_child(folder / "arm" / "seed0", env=fl.child_env())  # given the lock: allowed
        with pytest.raises(fl.FolderLocked):
            _check_free_in_child(folder / "arm" / "seed0")  # not given it: refused
        with fl.hold(folder):  # held already by this process: fine, and still held after
            pass
        assert (folder / fl.LOCK_NAME).exists()
    assert not (tmp_path / "new").exists()  # made for the lock, left empty: removed


def test_a_held_lock_refuses_another_holder_in_process(tmp_path):
    proc = holder(tmp_path / "f")
    try:
        with pytest.raises(fl.FolderLocked, match=rf"is being written by PID {proc.pid} on "):
            with fl.hold(tmp_path / "f"):
                pass
        with pytest.raises(fl.FolderLocked, match=rf"is being written by PID {proc.pid} on "):
            fl.check_free(tmp_path / "f" / "a" / "b")
    finally:
        proc.kill()
        proc.wait()
    fl.check_free(tmp_path / "f" / "a" / "b")  # its holder is gone: the lock is stale, nothing refuses
