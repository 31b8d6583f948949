"""Run records: one training run's folder read into a ``Run``, and the per-run measures of the comparison.

A run directory (one algorithm, one seed) holds ``config.yaml`` (the resolved settings), ``metrics.jsonl`` (one
JSON object per RL step) and, once the run has finished, ``eval.json`` (held-out avg@k, pass@k, greedy accuracy,
overall and on the hard cases, and the warm start's numbers before RL). OpenRLHF runs are read into the same
record from their TensorBoard logs (``stare.cli.tensorboard_runs``).

1. ``load_run``: one run directory -> ``Run``;
2. per-run measures (final reward, start and late-run entropy, band share, late reward slope, held-out
   numbers) and ``summarise_arm``: the measures of one arm's seeds, with their mean, sample std and count.

A measure that cannot be computed (no eval.json, a key the metrics never logged, one seed for a std) is None
and is written as a blank cell; it is never replaced by 0.
"""
from __future__ import annotations

import json
import math
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path

import yaml

# Windows over the end of a run, in percent of its recorded steps (at least one step each).
FINAL_PCT = 10  # final reward
LATE_PCT = 25  # late-run entropy and band share
SLOPE_PCT = 50  # late reward slope


# ---- 1. one run directory ---------------------------------------------------------------------------------------
@dataclass
class Run:
    path: Path
    algo: str
    seed: int | None
    config: dict
    metrics: list[dict]  # one record per step, sorted by step
    eval: dict | None  # eval.json, None while the run has not finished


def load_run(path) -> Run:
    """Read a run directory; ValueError naming the file when config.yaml or metrics.jsonl is missing or malformed."""
    path = Path(path)
    config_path, metrics_path, eval_path = path / "config.yaml", path / "metrics.jsonl", path / "eval.json"

    if not config_path.is_file():
        raise ValueError(f"{path} is not a run directory: no config.yaml there")
    try:
        config = yaml.safe_load(config_path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{config_path} is not valid YAML: {exc}") from None
    algo = config.get("algo") if isinstance(config, dict) else None
    if not isinstance(algo, dict) or not isinstance(algo.get("name"), str):
        raise ValueError(f"{config_path} is malformed: expected a mapping with algo.name")
    settings = config.get("settings") or {}
    if not isinstance(settings, dict):
        raise ValueError(f"{config_path} is malformed: settings must be a mapping")
    seed = settings.get("seed")

    if not metrics_path.is_file():
        raise ValueError(f"{path}: no metrics.jsonl there (the run never started?)")
    text = metrics_path.read_text()
    lines = text.splitlines()
    metrics = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines) and not text.endswith("\n"):  # a run killed while writing its last line
                warnings.warn(f"{metrics_path}: ignoring the truncated last line {lineno}")
                break
            raise ValueError(f"{metrics_path} line {lineno} is not valid JSON: {exc}") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or isinstance(rec["step"], bool):
            raise ValueError(f"{metrics_path} line {lineno} is malformed: expected a JSON object with an integer step")
        metrics.append(rec)
    if not metrics:
        raise ValueError(f"{metrics_path} holds no steps")
    metrics.sort(key=lambda r: r["step"])
    steps = [r["step"] for r in metrics]
    if len(set(steps)) != len(steps):
        raise ValueError(f"{metrics_path} is malformed: a step appears more than once")

    result = None
    if eval_path.is_file():
        try:
            result = json.loads(eval_path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{eval_path} is not valid JSON: {exc}") from None
        if not isinstance(result, dict) or not isinstance(result.get("k"), int):
            raise ValueError(f"{eval_path} is malformed: expected a JSON object with an integer k")
    return Run(path=path, algo=algo["name"], seed=seed, config=config, metrics=metrics, eval=result)


# ---- 2. per-run measures and one arm's summary ------------------------------------------------------------------
def _num(value) -> float | None:
    """A finite number as float; anything else (absent, None, NaN, a string, a bool) is None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _tail(records: list[dict], pct: int) -> list[dict]:
    """The last ``pct`` percent of the records (rounded up, at least one)."""
    n = max(1, -(-len(records) * pct // 100))
    return records[-n:]


def _values(records: list[dict], key: str) -> list[float]:
    """The key's values in the records that have it (a missing key is absent, not 0)."""
    return [v for v in (_num(r.get(key)) for r in records) if v is not None]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _slope_per_100(records: list[dict], key: str) -> float | None:
    """Least-squares slope of ``key`` against step, per 100 steps (None with fewer than two steps)."""
    pts = [(float(r["step"]), v) for r in records if (v := _num(r.get(key))) is not None]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    return 100 * sum((x - mx) * (y - my) for x, y in pts) / sxx


def _band(run: Run) -> tuple[float, float] | None:
    low, high = _num(run.config["algo"].get("band_low")), _num(run.config["algo"].get("band_high"))
    return None if low is None or high is None else (low, high)


def band_share(band: tuple[float, float] | None, entropies: list[float]) -> float | None:
    """Share of ``entropies`` inside ``band`` (None when there is no band or no value)."""
    if not band or not entropies:
        return None
    return sum(band[0] <= h <= band[1] for h in entropies) / len(entropies)


def _held_out(result: dict | None, k: int | None) -> dict:
    """avg@k, pass@k and greedy accuracy of one eval.json block (None where absent)."""
    result = result if isinstance(result, dict) else {}
    return {"avg_at_k": _num(result.get(f"avg_at_{k}")), "pass_at_k": _num(result.get(f"pass_at_{k}")),
            "greedy_accuracy": _num(result.get("greedy_accuracy"))}


def run_measures(run: Run) -> dict:
    """The per-run numbers of the comparison (see the module docstring for the windows)."""
    m = run.metrics
    late = _tail(m, LATE_PCT)
    start = _num(m[0].get("entropy"))
    late_h = _values(late, "entropy")
    late_mean = _mean(late_h)
    band = _band(run)
    k = run.eval["k"] if run.eval else None
    held = _held_out(run.eval, k)
    hard = _held_out(run.eval.get("hard"), k) if run.eval else _held_out(None, k)
    return {
        "final_reward": _mean(_values(_tail(m, FINAL_PCT), "reward_mean")),
        "start_entropy": start,
        "late_entropy": late_mean,
        "late_start_ratio": late_mean / start if late_mean is not None and start else None,
        "band_share": band_share(band, late_h),
        "late_reward_slope": _slope_per_100(_tail(m, SLOPE_PCT), "reward_mean"),
        **held,
        **{f"hard_{name}": v for name, v in hard.items()},
    }


MEASURES = ("final_reward", "avg_at_k", "pass_at_k", "greedy_accuracy", "start_entropy", "late_entropy",
            "late_start_ratio", "band_share", "late_reward_slope", "hard_avg_at_k", "hard_pass_at_k",
            "hard_greedy_accuracy")


def _aggregate(values: list[float | None]) -> dict:
    """Mean, sample std (None for one value) and count of the values that are not None."""
    present = [v for v in values if v is not None]
    return {"mean": _mean(present), "std": statistics.stdev(present) if len(present) > 1 else None,
            "n": len(present)}


def _common_k(runs: list[Run]) -> int | None:
    ks = {r.eval["k"] for r in runs if r.eval}
    if len(ks) > 1:
        raise ValueError(f"the runs were evaluated with different k ({', '.join(map(str, sorted(ks)))}); "
                         "avg@k and pass@k are comparable only for one k")
    return ks.pop() if ks else None


def summarise_arm(runs: list[Run]) -> dict:
    """One arm's seeds: each run's measures and, per measure, mean, sample std and count over the seeds.

    Returns ``{"arm", "n_seeds", "seeds", "k", "metrics": {measure: {"mean", "std", "n"}}, "runs": [...]}``;
    the measures are named as in ``MEASURES`` (``avg_at_k`` etc., with ``k`` given separately).
    """
    if not runs:
        raise ValueError("summarise_arm needs at least one run")
    names = {r.algo for r in runs}
    if len(names) > 1:
        raise ValueError(f"summarise_arm takes the runs of one algorithm, got {', '.join(sorted(names))}")
    seeds = [r.seed for r in runs]
    dup = {s for s in seeds if s is not None and seeds.count(s) > 1}
    if dup:
        raise ValueError(f"arm {runs[0].algo} has more than one run with seed {sorted(dup)[0]}: "
                         + ", ".join(str(r.path) for r in runs if r.seed in dup))
    k = _common_k(runs)
    per_run = []
    for r in runs:
        planned = (r.config.get("settings") or {}).get("steps")
        per_run.append({"path": str(r.path), "seed": r.seed, "steps": r.metrics[-1]["step"],
                        "planned_steps": planned, "has_eval": r.eval is not None, **run_measures(r)})
    return {
        "arm": runs[0].algo,
        "n_seeds": len(runs),
        "seeds": seeds,
        "k": k,
        "metrics": {name: _aggregate([p[name] for p in per_run]) for name in MEASURES},
        "runs": per_run,
    }
