"""`stare eval` killed with SIGKILL mid-run, then `--resume`: the same summary as an uninterrupted run, no sample twice
(on the HF backend, in both --batching modes it has; the real vLLM engine's is in tests/test_vllm_cpu.py)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tiny_models import PROBLEMS, build_tiny_model, write_problems

K = 2
# Runs `stare eval` with every HF batch slowed down by DELAY seconds, so the test can kill it between two batches;
# the slow-down lives only here, in the process the test starts.
SLOW_STARE = """
import sys, time
from stare.eval import backends
DELAY = float(sys.argv[1])
batch = backends.HFBackend._batch
def slow_batch(self, *args, **kwargs):
    time.sleep(DELAY)
    return batch(self, *args, **kwargs)
backends.HFBackend._batch = slow_batch
sys.argv = ["stare", *sys.argv[2:]]
from stare.cli.main import main
main()
"""


def stare(*args, env=None):
    return subprocess.run([sys.executable, "-m", "stare.cli.main", *args], capture_output=True, text=True, env=env)


def lines(path):
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize("batching", ["all", "problem"])
def test_kill_9_then_resume_gives_the_uninterrupted_result(tmp_path, batching):
    model = build_tiny_model(tmp_path / "model", train=True, steps=150)
    rows = PROBLEMS + [{"id": "p4", "problem": "What is 1+4?", "answer": "5"}]
    data = write_problems(tmp_path / "mini.jsonl", rows)
    args = ["eval", "--bench", "aime25", "--model", str(model), "--data-file", str(data), "--k", str(K),
            "--max-tokens", "12", "--backend", "hf", "--seed", "3", "--batching", batching]
    # with all: HF batches of two problems (each prompt and response here is under 40 tokens), so a kill can land
    # between batches; the uninterrupted run batches all four at once, the resumed one what is left
    small = {**os.environ, "STARE_HF_BATCH_TOKENS": str(2 * K * 40)}

    full = tmp_path / "full"
    res = stare(*args, "--out", str(full))
    assert res.returncode == 0, res.stderr[-2000:]

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_STARE, "1.0", *args, "--out", str(killed)], env=small,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not lines(killed / "samples.jsonl") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]  # still running: the kill lands mid-run
        assert lines(killed / "samples.jsonl")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and its scoring workers, which share its process group
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    partial = lines(killed / "samples.jsonl")
    assert 1 <= len(partial) < len(rows) * K and not (killed / "summary.json").exists()

    res = stare(*args, "--out", str(killed), "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    resumed = [json.loads(x) for x in lines(killed / "samples.jsonl")]
    keys = [(r["problem_id"], r["sample_idx"]) for r in resumed]
    assert len(keys) == len(set(keys)) == len(rows) * K  # every sample once
    assert lines(killed / "samples.jsonl") == lines(full / "samples.jsonl")
    # finished problems were kept (the file is rewritten in the bench's order once every problem is done)
    assert set(partial) <= set(lines(killed / "samples.jsonl"))

    want = json.loads((full / "summary.json").read_text())
    got = json.loads((killed / "summary.json").read_text())
    assert got == want
    # and the numbers are the ones the samples say, not just equal to each other
    per_problem = [sum(r["correct"] for r in resumed if r["problem_id"] == p["id"]) / K for p in rows]
    assert got["avg_at_k"] == pytest.approx(sum(per_problem) / len(rows))
