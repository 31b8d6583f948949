"""The local engine end to end: tasks, a resumed run after kill -9, a shortened `stare run`, bad input."""
import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from stare.cli.local.tasks import MARKER, TRIGGER, get_task

# small enough for seconds per arm on two cores
FAST = ["warmstart_steps=100", "warmstart_noise=0.3", "eval_problems=8", "prompts_per_step=4", "samples_per_prompt=4",
        "train_problems=200", "micro_batch_size=8",
        "seeds=1"]


def stare(*args, cwd=None, **kw):
    return subprocess.run([sys.executable, "-m", "stare.cli.main", *args], capture_output=True, text=True,
                          cwd=cwd, **kw)


def read_metrics(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_tasks_split_and_rewards():
    task = get_task("reverse")
    train = task.problems(500, seed=0, split="train")
    test = task.problems(200, seed=0, split="test")
    assert not {p.prompt for p in train} & {p.prompt for p in test}
    assert task.problems(5, seed=3, split="train") == task.problems(5, seed=3, split="train")
    p = train[0]
    assert p.answer == p.prompt[::-1]
    assert task.reward(p, p.prompt[::-1]) == 1.0 and task.reward(p, p.prompt) == (1.0 if p.prompt == p.answer else 0.0)
    explore = get_task("explore")
    probs = explore.problems(400, seed=1, split="train")
    hard = [q for q in probs if q.hard]
    assert 20 < len(hard) < 100  # about one in eight
    for q in hard:
        assert q.prompt[0] == TRIGGER and q.answer == q.prompt[::-1][:-1] + MARKER
    for q in probs:
        if not q.hard:
            assert TRIGGER not in q.prompt and q.answer == q.prompt[::-1]
    with pytest.raises(ValueError, match="unknown task 'sort'; valid tasks"):
        get_task("sort")


def test_killed_run_resumes_to_the_same_metrics(tmp_path):
    args = ["train", "--preset", "tiny-cpu", "--algo", "stare-phi", *sum((["--set", s] for s in
            FAST + ["steps=40", "save_every=7"]), [])]
    straight = tmp_path / "straight"
    res = stare(*args, "--out", str(straight))
    assert res.returncode == 0, res.stderr
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "stare.cli.main", *args, "--out", str(killed)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        metrics = killed / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 16:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    lines_at_kill = len(read_metrics(killed))
    assert 16 <= lines_at_kill < 40 and not (killed / "eval.json").exists()
    res = stare(*args, "--out", str(killed), "--resume")
    assert res.returncode == 0, res.stderr

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "time_s"} for r in rows]

    a, b = strip(read_metrics(straight)), strip(read_metrics(killed))
    assert [r["step"] for r in b] == list(range(1, 41))
    assert a == b
    assert json.loads((straight / "eval.json").read_text()) == json.loads((killed / "eval.json").read_text())
    # the final policy loads with from_pretrained
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(killed / "final")
    tok = AutoTokenizer.from_pretrained(killed / "final")
    assert model.config.vocab_size == len(tok) and tok.decode(tok("abc>")["input_ids"]) == "abc>"


def test_short_stare_run_end_to_end(tmp_path):
    out = tmp_path / "demo"
    sets = sum((["--set", s] for s in FAST + ["steps=6"]), [])
    res = stare("run", "--preset", "tiny-cpu", "--out", str(out), *sets)
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("comparison.md", "comparison.csv", "entropy.png", "reward.png", "response_length.png"):
        assert (out / name).stat().st_size > 100, name
    assert (out / "entropy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    arms = ["grpo", "dapo", "stare", "stare-phi"]
    rows = list(csv.DictReader((out / "comparison.csv").open()))
    assert [r["arm"] for r in rows if r["arm"] != "warmstart"] == arms
    base = {"step", "reward_mean", "stare/entropy", "response_length", "clip_frac_low", "clip_frac_high",
            "stare/entropy_forecast", "stare/entropy_change_same_batch", "stare/pos_low_share",
            "stare/pos_high_share", "stare/neg_low_share", "stare/neg_high_share", "stare/tokens"}
    stare_keys = {"stare/gate_on", "stare/w", "stare/m", "stare/positive_reweight_ratio",
                  "stare/negative_reweight_ratio"}
    for arm in arms:
        run_dir = out / arm
        metrics = [r for r in read_metrics(run_dir) if not r.get("skipped")]
        assert len(read_metrics(run_dir)) == 6 and metrics
        for r in metrics:
            assert base <= set(r), base - set(r)
            assert ("stare/entropy_change" in r) == (r["step"] > 1)  # against the previous step's entropy
            if arm.startswith("stare"):
                assert stare_keys <= set(r), stare_keys - set(r)
        ev = json.loads((run_dir / "eval.json").read_text())
        assert {"avg_at_8", "pass_at_8", "greedy_accuracy", "warmstart"} <= set(ev)
        assert 0 <= ev["avg_at_8"] <= ev["pass_at_8"] <= 1
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert cfg["algo"]["name"] == arm and cfg["settings"]["steps"] == 6
        assert (run_dir / "checkpoint" / "trainer_state.pt").exists() and (run_dir / "final" / "config.json").exists()
    assert (out / "warmstart" / "seed0" / "warmstart.json").exists()
    # a second run into the same folder without --resume changes nothing; with --resume, finished arms are kept
    before = (out / "grpo" / "metrics.jsonl").read_text()
    res = stare("run", "--preset", "tiny-cpu", "--out", str(out), *sets)
    assert res.returncode == 2 and "already holds a run" in res.stderr
    res = stare("run", "--preset", "tiny-cpu", "--out", str(out), "--resume", *sets)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (out / "grpo" / "metrics.jsonl").read_text() == before
    # another preset into this folder: refused, nothing overwritten
    res = stare("run", "--preset", "tiny-explore", "--out", str(out), *sets)
    assert res.returncode == 2 and "holds a run of preset 'tiny-cpu'" in res.stderr
    assert (out / "grpo" / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("args, message", [
    (["run", "--preset", "tiny-cpu", "--algos", "grpo,ppo"], "unknown algorithm 'ppo'; valid algorithms"),
    (["run", "--preset", "tiny-cpu", "--bench", "aime25"], "--bench is for GPU presets; 'tiny-cpu' is a local"),
    (["train", "--preset", "tiny-cpu", "--resume"], "nothing to resume"),
    (["run", "--preset", "tiny-cpu", "--set", "lr=fast"], "--set lr=fast: expected"),
])
def test_bad_input_one_line_exit_2(tmp_path, args, message):
    res = stare(*args, "--out", str(tmp_path / "x"))
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in res.stderr
    assert not (tmp_path / "x").exists()


def _hand_dapo_loss(lp, old, adv, mask, weights, n_tok, clip=(0.2, 0.28), dual_clip=10.0):
    """DAPO's token-mean clipped loss with dual clip, each token's loss times its weight, written out by hand."""
    ratio = torch.exp(lp - old)
    a = adv[:, None].expand_as(lp)
    per_token = -torch.minimum(ratio * a, ratio.clamp(1 - clip[0], 1 + clip[1]) * a)
    per_token = torch.where(a < 0, torch.minimum(per_token, -dual_clip * a), per_token)
    return (per_token * weights * mask).sum() / n_tok


def _micro_batch_o1(old, adv, mask, ratio, w):
    """The paper's O1 rule inside one micro-batch, by sorting: W on the top ceil(ratio n) surprisal A > 0 tokens."""
    pos = mask.bool() & (adv[:, None] > 0)
    weights = torch.ones_like(old)
    if pos.any():
        s = -old[pos]
        k = max(1, math.ceil(round(ratio * s.numel(), 9)))
        weights[pos & (-old >= torch.sort(s, descending=True).values[k - 1])] = w
    return weights


def test_weights_change_the_loss_exactly_when_the_gate_is_on(tmp_path, monkeypatch):
    """stare (O1, W 2) with scope micro_batch, the gate forced on, off, on, off by its target: on gate-on steps the
    loss of every micro-batch is the hand-written loss with the micro-batch's own brute-force selection, and the
    step's loss differs from the unweighted one; on gate-off steps no weights reach the loss."""
    from stare.algorithms import METRIC_NAMES
    from stare.cli.local import trainer as trainer_mod
    from stare.cli.presets import resolve
    from stare.cli.rundir import prepare_run_dir

    sets = [s for s in FAST if not s.startswith("micro_batch_size")] + [
        "steps=4", "eval_problems=2", "micro_batch_size=4", "mini_batches=2",
        "scope=micro_batch", "w=2.0", "target_entropy=100.0"]
    res = resolve("tiny-cpu", "stare", sets)
    out = tmp_path / "run"
    prepare_run_dir(out, res, False)
    tr = trainer_mod.LocalTrainer(res, out)
    calls, step = [], [1]
    real = trainer_mod.policy_loss

    def spy(lp, old, adv, mask, **kw):
        loss, m = real(lp, old, adv, mask, **kw)
        calls.append({"step": step[0], "lp": lp.detach().clone(), "old": old.clone(), "adv": adv.clone(),
                      "mask": mask.clone(), "weights": kw["weights"], "n_tok": kw["num_tokens"],
                      "loss": loss.detach()})
        return loss, m

    def on_step(done, steps, rec):  # the real controller decides; only its target moves: on, off, on, off
        step[0] = done + 1
        tr.controller.target_entropy = 1e-6 if done % 2 == 1 else 100.0

    monkeypatch.setattr(trainer_mod, "policy_loss", spy)
    tr.run(on_step=on_step)
    records = read_metrics(out)
    seen = {"on": 0, "off": 0}
    for rec in records:
        if rec.get("skipped"):
            continue
        assert {k for k in rec if k.startswith("stare/")} <= set(METRIC_NAMES)
        gate_on = rec["stare/gate_on"] == 1.0
        assert gate_on == (rec["step"] % 2 == 1)
        mine = [c for c in calls if c["step"] == rec["step"]]
        assert sum(c["lp"].shape[0] for c in mine) == rec["batch_prompts"] * 4  # every sequence trained once
        plain = [_hand_dapo_loss(c["lp"], c["old"], c["adv"], c["mask"], torch.ones_like(c["lp"]), c["n_tok"])
                 for c in mine]
        if gate_on:
            seen["on"] += 1
            for c in mine:
                expected = _micro_batch_o1(c["old"], c["adv"], c["mask"], 0.1, 2.0)
                assert torch.equal(c["weights"], expected)
                hand = _hand_dapo_loss(c["lp"], c["old"], c["adv"], c["mask"], expected, c["n_tok"])
                assert c["loss"] == pytest.approx(float(hand), rel=1e-5, abs=1e-8)
            total, total_plain = sum(float(c["loss"]) for c in mine), sum(float(p) for p in plain)
            assert abs(total - total_plain) > 1e-3 * max(abs(total_plain), 1e-3)
            assert rec["stare/mean_weight"] > 1.0 and rec["stare/positive_reweight_ratio"] > 0
        else:
            seen["off"] += 1
            assert all(c["weights"] is None for c in mine)
            for c, p in zip(mine, plain):
                assert c["loss"] == pytest.approx(float(p), rel=1e-5, abs=1e-8)
            assert rec["stare/mean_weight"] == 1.0 and rec["stare/positive_reweight_ratio"] == 0.0
    assert seen["on"] >= 1 and seen["off"] >= 1, seen
