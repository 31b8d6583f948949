"""A local `stare run` whose one arm fails: the policy a GPU preset's `stare run` has (issue 55).

The failure is planted in the arm's worker process through a ``sitecustomize`` module on ``PYTHONPATH`` (the local
engine's workers are spawned interpreters, which a patch in the parent would not reach): ``LocalTrainer.run`` raises
for the algorithm named in ``STARE_TEST_FAIL_ARM``. Checked: the other arm trains, is evaluated and gets its row;
the table's notes and stderr name the failure; the exit code is 1 with the command that continues; that command,
run without the planted failure, trains only the failed arm and leaves the finished one byte for byte.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

FAST = ["warmstart_steps=100", "warmstart_noise=0.3", "eval_problems=8", "prompts_per_step=4", "samples_per_prompt=4",
        "train_problems=200", "micro_batch_size=8", "seeds=1", "steps=4", "save_every=2"]

PLANT = """
import os
if os.environ.get("STARE_TEST_FAIL_ARM"):
    from stare.cli.local import trainer

    _run = trainer.LocalTrainer.run

    def run(self, *args, **kwargs):
        if self.resolved["algo"]["name"] == os.environ["STARE_TEST_FAIL_ARM"]:
            raise RuntimeError("planted failure\\nwith a second line the report leaves out")
        return _run(self, *args, **kwargs)

    trainer.LocalTrainer.run = run
"""


def hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_failed_local_arm_is_reported_the_others_finish_and_resume_retries_only_it(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PLANT)
    out = tmp_path / "run"
    args = ["run", "--preset", "tiny-cpu", "--algos", "grpo,stare", *sum((["--set", s] for s in FAST), []),
            "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "STARE_TEST_FAIL_ARM": "stare"}
    res = subprocess.run([sys.executable, "-m", "stare.cli.main", *args], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 1, res.stderr[-3000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    want = f"train stare failed: RuntimeError: planted failure (in {out / 'stare'})"
    assert f"failed: {want}" in lines, res.stderr[-3000:]
    assert lines[-1].startswith("error: 1 step(s) failed (above, and in the table's notes); fix and continue with: "
                                "stare run --preset tiny-cpu") and lines[-1].endswith(f"--out {out} --resume"), lines[-1]
    assert "second line" not in res.stderr and "Traceback" not in res.stderr
    # the other arm finished and has its row; the failure is in the notes
    assert (out / "grpo" / "eval.json").is_file() and not (out / "stare" / "eval.json").exists()
    table = json.loads((out / "comparison.json").read_text())
    assert [a["arm"] for a in table["arms"]] == ["grpo"]
    assert want in table["notes"], table["notes"]
    assert "| grpo |" in (out / "comparison.md").read_text()
    grpo = hashes(out / "grpo")

    env.pop("STARE_TEST_FAIL_ARM")
    again = subprocess.run([sys.executable, "-m", "stare.cli.main", *args, "--resume"], env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert hashes(out / "grpo") == grpo  # kept, byte for byte
    assert (out / "stare" / "eval.json").is_file()
    steps = [json.loads(ln)["step"] for ln in (out / "stare" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    table = json.loads((out / "comparison.json").read_text())
    assert [a["arm"] for a in table["arms"]] == ["grpo", "stare"]
    assert not any("failed" in n for n in table["notes"]), table["notes"]
