"""`stare compare` on fixture runs and eval outputs written by hand: numbers, blanks, plots, bad input."""
import csv
import json
import subprocess
import sys

import pytest
import yaml

from stare.cli.compare import compare


def make_run(path, algo, entropies, *, evals=()):
    path.mkdir(parents=True)
    cfg = {"preset": "tiny-cpu", "backend": "local",
           "algo": {"name": algo, "band_low": 0.3, "band_high": 0.45}, "settings": {"model": "tiny", "task": "reverse"}}
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = [{"step": i + 1, "reward_mean": 0.5, "entropy": h, "response_length": 10.0 + i} for i, h in enumerate(entropies)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    for bench, avg in evals:
        e = path / f"eval-{bench}"
        e.mkdir()
        (e / "summary.json").write_text(json.dumps({"bench": bench, "model": str(path / "final"), "k": 4,
                                                    "avg_at_k": avg, "pass_at_k": 0.9, "ci95": {"avg_at_k": [0.1, 0.6]},
                                                    "reflection_per_1k_tokens": 2.5, "mean_response_tokens": 100.0}))


def test_compare_numbers_and_blanks(tmp_path):
    # 20 steps: the last 10% are steps 19-20, the last 25% are steps 16-20
    ent = [0.8] * 15 + [0.35, 0.5, 0.31, 0.2, 0.4]
    make_run(tmp_path / "a", "stare-phi", ent, evals=[("aime24", 0.4), ("aime25", 0.25)])
    make_run(tmp_path / "b", "grpo", [0.1] * 20)
    standalone = tmp_path / "ev"
    standalone.mkdir()
    (standalone / "summary.json").write_text(json.dumps({"bench": "aime25", "model": "some/model", "k": 32,
                                                         "avg_at_k": 0.2, "pass_at_k": 0.5, "ci95": {"avg_at_k": [0.15, 0.25]},
                                                         "mean_response_tokens": 900.0}))
    out = tmp_path / "cmp"
    rows = compare([tmp_path / "a", tmp_path / "b", standalone], out)
    assert len(rows) == 3
    table = list(csv.DictReader((out / "comparison.csv").open()))
    a, b, ev = table
    assert float(a["final_entropy"]) == pytest.approx((0.2 + 0.4) / 2)
    assert float(a["band_share"]) == pytest.approx(3 / 5)  # 0.35, 0.31, 0.4 inside [0.30, 0.45]
    assert float(a["response_length"]) == pytest.approx(sum(10.0 + i for i in range(15, 20)) / 5)
    assert float(a["aime24_avg_at_k"]) == 0.4 and float(a["aime25_avg_at_k"]) == 0.25 and a["aime24_k"] == "4"
    assert float(a["reflection_per_1k_tokens"]) == 2.5
    assert b["aime24_avg_at_k"] == "" and b["aime25_avg_at_k"] == "" and float(b["band_share"]) == 0.0
    assert ev["algorithm"] == "" and ev["model"] == "some/model" and float(ev["aime25_avg_at_k"]) == 0.2
    assert ev["final_entropy"] == "" and ev["aime24_avg_at_k"] == ""
    md = (out / "comparison.md").read_text()
    assert "0.400 [0.100, 0.600] (k=4)" in md
    for name in ("entropy.png", "reward.png", "response_length.png", "reflection.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_folder_of_runs_expands(tmp_path):
    make_run(tmp_path / "demo" / "grpo", "grpo", [0.5] * 4)
    make_run(tmp_path / "demo" / "dapo", "dapo", [0.5] * 4)
    rows = compare([tmp_path / "demo"], tmp_path / "out")
    assert sorted(r["algorithm"] for r in rows) == ["dapo", "grpo"]


def test_bad_input_exit_2(tmp_path):
    (tmp_path / "empty").mkdir()
    res = subprocess.run([sys.executable, "-m", "stare.cli.main", "compare", str(tmp_path / "empty"), "--out",
                          str(tmp_path / "o")], capture_output=True, text=True)
    assert res.returncode == 2 and "holds no training run" in res.stderr and "Traceback" not in res.stderr
    assert len([x for x in res.stderr.splitlines() if x.strip()]) == 1
