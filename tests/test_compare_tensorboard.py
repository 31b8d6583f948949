"""`stare compare` on OpenRLHF runs: TensorBoard event files written here with torch's SummaryWriter under the tags
OpenRLHF and the STARE plugin use; the table's numbers are checked against values computed here from the lists
that were written."""
import csv
import json
import math
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("tensorboard", reason="tensorboard is not installed")
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

from stare.cli.report.compare import compare  # noqa: E402

STEPS = 20
# the last 10% of 20 steps: 19-20; the last 25%: 16-20
STARE_H = [0.9 - 0.02 * i for i in range(15)] + [0.36, 0.50, 0.32, 0.25, 0.41]
POLICY_H = [1.5] * STEPS  # train/entropy_loss: must lose to train/stare/entropy
REWARD = [0.1 + 0.03 * i for i in range(STEPS)]
LENGTH = [500.0 + 7 * i for i in range(STEPS)]


def write_scalars(folder, series, *, walltime0=1000.0):
    writer = SummaryWriter(log_dir=str(folder))
    for tag, values in series.items():
        for step, value in values:
            writer.add_scalar(tag, value, step, walltime=walltime0 + step)
    writer.close()


def steps(values, first=1):
    return list(enumerate(values, start=first))


def late(values, pct):
    n = math.ceil(len(values) * pct / 100)
    return values[-n:]


@pytest.fixture
def openrlhf_run(tmp_path):
    """A run folder as `stare train` on OpenRLHF leaves it: config.yaml, an eval, tensorboard/<run name>/ events,
    written by two writers (a restart) with step 10 logged twice."""
    root = tmp_path / "qwen-stare-phi"
    root.mkdir()
    (root / "config.yaml").write_text(yaml.safe_dump({
        "preset": "qwen-7b-short-cot", "backend": "openrlhf",
        "algo": {"name": "stare-phi", "band_low": 0.3, "band_high": 0.45},
        "settings": {"model": "Qwen/Qwen2.5-Math-7B"}}))
    (root / "eval-aime24").mkdir()
    (root / "eval-aime24" / "summary.json").write_text(json.dumps({
        "bench": "aime24", "model": "x", "k": 32, "avg_at_k": 0.31, "pass_at_k": 0.6,
        "ci95": {"avg_at_k": [0.2, 0.4]}}))
    events = root / "tensorboard" / "stare_phi_run"
    first = {"train/stare/entropy": steps(STARE_H[:9] + [0.99]), "train/entropy_loss": steps(POLICY_H[:10]),
             "train/reward": steps(REWARD[:10]), "train/response_length": steps(LENGTH[:10]),
             "eval/eval_aime24_pass1": [(10, 0.77)]}
    write_scalars(events, first)
    # the restart rewrites step 10 (0.99 -> the real value) and goes on to step 20
    second = {"train/stare/entropy": steps(STARE_H[9:], first=10), "train/entropy_loss": steps(POLICY_H[9:], first=10),
              "train/reward": steps(REWARD[9:], first=10), "train/response_length": steps(LENGTH[9:], first=10),
              "train/stare/target": steps([0.45] * STEPS), "train/stare/gate": steps([1.0] * STEPS),
              "train/stare/w": steps([2.0] * STEPS), "train/stare/m": steps([0.05] * STEPS)}
    write_scalars(events, second, walltime0=5000.0)
    assert len(list(events.glob("events.out.tfevents.*"))) == 2
    return root


def test_openrlhf_runs_in_the_table(openrlhf_run, tmp_path):
    # a second run with no config.yaml: OpenRLHF's own entropy, no response length
    bare = tmp_path / "tb" / "grpo_run"
    write_scalars(bare, {"train/entropy_loss": steps(POLICY_H), "train/reward": steps(REWARD)})
    out = tmp_path / "cmp"
    res = subprocess.run([sys.executable, "-m", "stare.cli.main", "compare", str(openrlhf_run), str(tmp_path / "tb"),
                          "--out", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    a, b = list(csv.DictReader((out / "comparison.csv").open()))

    assert a["arm"] == "stare-phi"
    assert float(a["late_entropy_mean"]) == pytest.approx(sum(late(STARE_H, 25)) / 5, rel=1e-6)  # the last 25%
    assert float(a["start_entropy_mean"]) == pytest.approx(STARE_H[0], rel=1e-6)
    assert float(a["final_reward_mean"]) == pytest.approx(sum(late(REWARD, 10)) / 2, rel=1e-6)
    in_band = [h for h in late(STARE_H, 25) if 0.3 <= h <= 0.45]  # 0.36, 0.32, 0.41
    assert float(a["band_share_mean"]) == pytest.approx(len(in_band) / 5) == 3 / 5
    assert float(a["late_response_length_mean"]) == pytest.approx(sum(late(LENGTH, 25)) / 5, rel=1e-6)
    assert float(a["aime24_avg_at_k_mean"]) == 0.31 and a["aime24_k"] == "32"
    assert a["avg_at_k_mean"] == ""  # no eval.json: OpenRLHF runs have only stare eval outputs

    assert b["arm"] == "openrlhf" and b["band_share_mean"] == ""  # no config: no band, no name
    assert float(b["late_entropy_mean"]) == pytest.approx(1.5)  # from train/entropy_loss
    assert b["late_response_length_mean"] == "" and b["aime24_avg_at_k_mean"] == ""
    md = (out / "comparison.md").read_text()
    assert "no eval.json" not in md  # that note is for local runs
    for name in ("entropy.png", "reward.png", "response_length.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tensorboard_run_records(openrlhf_run):
    from stare.cli.report.tensorboard_runs import event_dirs, load_tb_run

    (folder,) = event_dirs(openrlhf_run)
    run = load_tb_run(folder)
    assert [r["step"] for r in run.metrics] == list(range(1, STEPS + 1))
    assert [r["stare/entropy"] for r in run.metrics] == pytest.approx(STARE_H, rel=1e-6)  # step 10: the later write
    assert [r["reward_mean"] for r in run.metrics] == pytest.approx(REWARD, rel=1e-6)
    for key, value in (("stare/w", 2.0), ("stare/m", 0.05), ("stare/gate_on", 1.0), ("stare/target", 0.45)):
        assert [r[key] for r in run.metrics] == pytest.approx([value] * STEPS, rel=1e-6)  # stored as float32
    assert not any(key.startswith("eval") for r in run.metrics for key in r)


def test_unknown_tags_and_missing_tensorboard(tmp_path, monkeypatch):
    write_scalars(tmp_path / "other" / "run", {"loss/total": steps([1.0, 0.5])})
    res = subprocess.run([sys.executable, "-m", "stare.cli.main", "compare", str(tmp_path / "other"), "--out",
                          str(tmp_path / "o")], capture_output=True, text=True)
    assert res.returncode == 2 and "none of the tags stare compare reads" in res.stderr and "loss/total" in res.stderr
    assert len([x for x in res.stderr.splitlines() if x.strip()]) == 1 and "Traceback" not in res.stderr

    monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing.event_accumulator", None)
    with pytest.raises(ValueError, match="needs the tensorboard package"):
        compare([tmp_path / "other"], tmp_path / "o2")


def test_openrlhf_selection_telemetry(tmp_path):
    """The plugin's train/stare/* telemetry (and the legacy train/stare/boosted_raise_share) feeds the table."""
    root = tmp_path / "qwen-stare"
    root.mkdir()
    (root / "config.yaml").write_text(yaml.safe_dump({
        "preset": "qwen-7b-short-cot", "backend": "openrlhf", "algo": {"name": "stare", "band_low": 0.3,
                                                                       "band_high": 0.45}}))
    boosted = [0.5, 0.25, 0.75]  # steps 1, 3, 4: step 2 raised no weight, so the share is absent there
    write_scalars(root / "tensorboard" / "run", {
        "train/stare/entropy": steps([0.9, 0.8, 0.7, 0.6]), "train/reward": steps([0.1, 0.2, 0.3, 0.4]),
        "train/stare/gate_on": steps([1.0, 0.0, 1.0, 1.0]), "train/stare/mean_weight": steps([1.25, 1.0, 1.5, 1.25]),
        "train/stare/boosted_raise_share": list(zip((1, 3, 4), boosted)),
        "train/stare/entropy_forecast": steps([0.002, -0.001, 0.003, 0.004])})
    compare([root], tmp_path / "cmp")
    (arm,) = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["arms"]
    t = arm["telemetry"]
    assert t["gate_on_share"]["mean"] == pytest.approx(3 / 4)
    assert t["mean_weight"]["mean"] == pytest.approx(5 / 4)
    assert t["boosted_phi_pos_share"]["mean"] == pytest.approx(1.5 / 3)  # over the three steps that logged it
    assert t["entropy_forecast"]["mean"] == pytest.approx(0.002, rel=1e-6)
    assert t["entropy_forecast_base"]["mean"] is None and t["masked_share"]["n"] == 0  # never logged: blank
    md = (tmp_path / "cmp" / "comparison.md").read_text()
    row = next(line for line in md.split("## Selection telemetry")[1].splitlines() if line.startswith("| stare "))
    assert row == "| stare | 1 | 0.750 | 1.250 | 0.500 |  |  |  | +2.00e-03 |  |"


def test_openrlhf_token_rule_telemetry(tmp_path):
    """A token rule's own numbers, logged by the plugin as train/stare/<name> (dg's gate here), are read from
    TensorBoard like the shared telemetry: the arm's mean over the steps that logged each one."""
    root = tmp_path / "qwen-dg"
    root.mkdir()
    (root / "config.yaml").write_text(yaml.safe_dump({"preset": "qwen-7b-short-cot", "backend": "openrlhf",
                                                      "algo": {"name": "dg"}}))
    write_scalars(root / "tensorboard" / "run", {
        "train/stare/entropy": steps([0.9, 0.8, 0.7]), "train/reward": steps([0.1, 0.2, 0.3]),
        "train/stare/gate_mean": steps([0.5, 0.25, 0.75]), "train/stare/gate_low_share": list(zip((1, 3), (0.1, 0.3)))})
    compare([root], tmp_path / "cmp")
    (arm,) = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["arms"]
    assert arm["telemetry"]["gate_mean"]["mean"] == pytest.approx(0.5)
    assert arm["telemetry"]["gate_low_share"]["mean"] == pytest.approx(0.2)
    assert arm["telemetry"]["gate_high_share"]["n"] == 0
