"""Run records: one training run's folder read into a ``Run``, and the per-run measures of the comparison.

A run directory (one algorithm, one seed) holds ``config.yaml`` (the resolved settings), ``metrics.jsonl`` (one
JSON object per RL step) and, once the run has finished, ``eval.json`` (held-out avg@k, pass@k, greedy accuracy,
overall and on the hard cases, and the warm start's numbers before RL), and the ``eval-<bench>/summary.json``
folders of ``stare eval --out RUN`` (``Run.evals``), and the accuracy-over-training curves (``Run.curves``: the
``eval-<bench>/step-<S>/`` folders of ``stare eval --checkpoints``, the ``heldout/*`` metrics of ``eval_every``).
OpenRLHF runs are read into the same record from their
TensorBoard logs (``tensorboard_runs``).

1. ``load_run``: one run directory -> ``Run``;
2. per-run measures (final reward, start and late-run entropy, band share, late reward slope, late response
   length, held-out numbers), the selection telemetry's step means (``TELEMETRY``), per-benchmark numbers
   (``summarise_benches``) and ``summarise_arm``: the measures of one arm's seeds, with their mean, sample std
   and count. The table (``tables``) and the plots (``plots``) read these, for
   ``stare run`` and ``stare compare`` alike.

A measure that cannot be computed (no eval.json, a key the metrics never logged, one seed for a std) is None
and is written as a blank cell; it is never replaced by 0.
"""
from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from stare.algorithms import upgrade_metric_names
from stare.algorithms.token_rules import RULES
from stare.eval.data import BENCHES
from stare.eval.metrics import compared
from stare.eval.summary import read_summary

from ..presets import read_config

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
    evals: dict = field(default_factory=dict)  # bench -> summary.json of a ``stare eval`` of this run
    # accuracy over training: curve key -> {"label", "points": {step: {"value", "ci_low", "ci_high", "k"}}}
    # (``read_checkpoint_curves``, ``heldout_curve``, ``tensorboard_runs.eval_curves``)
    curves: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)  # what reading it skipped (a cut last line): the comparison's warnings


BENCH_ORDER = tuple(BENCHES)  # the order of the comparison's bench columns: the benchmarks' own


def read_evals(folder: Path) -> dict[str, dict]:
    """bench -> summary.json of the ``eval-<bench>/`` folders in a run's folder (``stare eval --out RUN``)."""
    found = {}
    for sub in sorted(Path(folder).glob("eval-*")):
        if (sub / "summary.json").is_file():
            summary = read_summary(sub)
            found[summary["bench"]] = summary
    return found


def read_checkpoint_curves(folder: Path) -> dict[str, dict]:
    """The ``stare eval --checkpoints`` sweeps of a run (``eval-<bench>/step-<S>/summary.json``) as curves, one per
    bench: key ``<bench>_checkpoint``, each step's avg@k with its 95% bootstrap interval and k."""
    curves: dict[str, dict] = {}
    for sub in sorted(Path(folder).glob("eval-*/step-*/summary.json")):
        m = re.fullmatch(r"step-(\d+)", sub.parent.name)
        if m is None:
            continue
        summary = read_summary(sub.parent)
        ci = (summary.get("ci95") or {}).get("avg_at_k") or [None, None]
        curve = curves.setdefault(f"{summary['bench']}_checkpoint",
                                  {"label": f"{summary['bench']} (checkpoints)", "points": {}})
        curve["points"][int(m.group(1))] = {"value": num(summary.get("avg_at_k")), "ci_low": num(ci[0]),
                                            "ci_high": num(ci[1]), "k": summary.get("k")}
    return curves


HELDOUT_CURVE = "heldout_in_training"  # the local engine's eval_every (``heldout/*`` in metrics.jsonl)


def heldout_curve(metrics: list[dict]) -> dict[str, dict]:
    """The local engine's in-training held-out avg@k (setting ``eval_every``) as a curve; none when never logged."""
    points = {r["step"]: {"value": num(r.get("heldout/avg_at_k")), "ci_low": num(r.get("heldout/ci_low")),
                          "ci_high": num(r.get("heldout/ci_high")), "k": r.get("heldout/k")}
              for r in metrics if num(r.get("heldout/avg_at_k")) is not None}
    return {HELDOUT_CURVE: {"label": "held-out (in training)", "points": points}} if points else {}


def load_run(path) -> Run:
    """Read a run directory; ValueError naming the file when config.yaml or metrics.jsonl is missing or malformed."""
    path = Path(path)
    config_path, metrics_path, eval_path = path / "config.yaml", path / "metrics.jsonl", path / "eval.json"

    if not config_path.is_file():
        raise ValueError(f"{path} is not a run directory: no config.yaml there")
    try:
        config = read_config(config_path)
    except ValueError as exc:
        raise ValueError(f"{exc} (expected a mapping with algo.name)") from None
    algo = config.get("algo")
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
    metrics, skipped = [], []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines) and not text.endswith("\n"):  # a run killed while writing its last line
                skipped.append(f"{metrics_path}: its last line ({lineno}) was cut off while it was written "
                               "(the run was stopped); it is left out")
                break
            raise ValueError(f"{metrics_path} line {lineno} is not valid JSON: {exc}") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or isinstance(rec["step"], bool):
            raise ValueError(f"{metrics_path} line {lineno} is malformed: expected a JSON object with an integer step")
        metrics.append(upgrade_metric_names(rec))  # runs written before the stare/* names read the same
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
    return Run(path=path, algo=algo["name"], seed=seed, config=config, metrics=metrics, eval=result,
               evals=read_evals(path), curves={**heldout_curve(metrics), **read_checkpoint_curves(path)},
               warnings=skipped)


# ---- 2. per-run measures and one arm's summary ------------------------------------------------------------------
def num(value) -> float | None:
    """A finite number as float; anything else (absent, None, NaN, a string, a bool) is None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def tail(records: list[dict], pct: int) -> list[dict]:
    """The last ``pct`` percent of the records (rounded up, at least one)."""
    n = max(1, -(-len(records) * pct // 100))
    return records[-n:]


def values(records: list[dict], key: str) -> list[float]:
    """The key's values in the records that have it (a missing key is absent, not 0)."""
    return [v for v in (num(r.get(key)) for r in records) if v is not None]


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def slope_per_100(records: list[dict], key: str) -> float | None:
    """Least-squares slope of ``key`` against step, per 100 steps (None with fewer than two steps)."""
    pts = [(float(r["step"]), v) for r in records if (v := num(r.get(key))) is not None]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    return 100 * sum((x - mx) * (y - my) for x, y in pts) / sxx


def run_band(run: Run) -> tuple[float, float] | None:
    low, high = num(run.config["algo"].get("band_low")), num(run.config["algo"].get("band_high"))
    return None if low is None or high is None else (low, high)


def band_share(band: tuple[float, float] | None, entropies: list[float]) -> float | None:
    """Share of ``entropies`` inside ``band`` (None when there is no band or no value)."""
    if not band or not entropies:
        return None
    return sum(band[0] <= h <= band[1] for h in entropies) / len(entropies)


def held_out(result: dict | None, k: int | None) -> dict:
    """avg@k, pass@k and greedy accuracy of one eval.json block (None where absent).

    Reads ``avg_at_k`` / ``pass_at_k`` (the field names ``summary.json`` uses too) and, for eval.json files written
    before those were added, ``avg_at_{k}`` / ``pass_at_{k}``.
    """
    result = result if isinstance(result, dict) else {}

    def first(*keys):
        return next((v for v in (num(result.get(key)) for key in keys) if v is not None), None)

    return {"avg_at_k": first("avg_at_k", f"avg_at_{k}"), "pass_at_k": first("pass_at_k", f"pass_at_{k}"),
            "greedy_accuracy": num(result.get("greedy_accuracy"))}


def run_measures(run: Run) -> dict:
    """The per-run numbers of the comparison (see the module docstring for the windows)."""
    m = run.metrics
    late = tail(m, LATE_PCT)
    start = num(m[0].get("stare/entropy"))
    late_h = values(late, "stare/entropy")
    late_mean = mean(late_h)
    band = run_band(run)
    k = run.eval["k"] if run.eval else None
    held = held_out(run.eval, k)
    hard = held_out(run.eval.get("hard"), k) if run.eval else held_out(None, k)
    return {
        "final_reward": mean(values(tail(m, FINAL_PCT), "reward_mean")),
        "start_entropy": start,
        "late_entropy": late_mean,
        "late_start_ratio": late_mean / start if late_mean is not None and start else None,
        "band_share": band_share(band, late_h),
        "late_reward_slope": slope_per_100(tail(m, SLOPE_PCT), "reward_mean"),
        "late_response_length": mean(values(late, "response_length")),
        **held,
        **{f"hard_{name}": v for name, v in hard.items()},
    }


@dataclass(frozen=True)
class Telemetry:
    """One column of the comparison's selection telemetry: the measure's name, the metric the engines log (its
    meaning: ``stare.algorithms.step.METRICS``), the table's header, its digits, and whether it is signed (written
    as +1.00e-03); for a token rule's own number, the rule's name and the metric's meaning (the column is shown only
    when some arm logged it)."""
    name: str
    key: str
    header: str
    digits: int = 3
    signed: bool = False
    rule: str | None = None
    meaning: str = ""


# The selection telemetry, written once: what each run's mean is taken of (the steps that logged the key; gate_on's
# mean is the share of steps with the gate on; None when no step did) and how the table shows it. The shared
# columns here, then each token rule's own, as the rule declares them (``TokenRule.telemetry``).
TELEMETRY_COLUMNS: tuple[Telemetry, ...] = (
    Telemetry("gate_on_share", "stare/gate_on", "gate on"),
    Telemetry("mean_weight", "stare/mean_weight", "mean weight"),
    Telemetry("boosted_phi_pos_share", "stare/boosted_phi_pos_share", "boosted Phi>0"),
    Telemetry("lowered_phi_pos_share", "stare/lowered_phi_pos_share", "lowered Phi>0"),
    Telemetry("masked_share", "stare/masked_share", "masked"),
    Telemetry("penalised_share", "stare/penalised_share", "penalised"),
    Telemetry("entropy_forecast", "stare/entropy_forecast", "forecast", 2, True),
    Telemetry("entropy_forecast_base", "stare/entropy_forecast_base", "forecast unweighted", 2, True),
    *(Telemetry(m.name, f"stare/{m.name}", m.header, rule=rule.name, meaning=m.meaning)
      for rule in RULES.values() for m in rule.telemetry),
)
TELEMETRY: dict[str, str] = {t.name: t.key for t in TELEMETRY_COLUMNS}  # measure -> logged metric


def run_telemetry(run: Run) -> dict[str, float | None]:
    """The run's ``TELEMETRY`` means over the steps that logged each key (None: never logged, not 0)."""
    return {name: mean(values(run.metrics, key)) for name, key in TELEMETRY.items()}


MEASURES = ("final_reward", "avg_at_k", "pass_at_k", "greedy_accuracy", "start_entropy", "late_entropy",
            "late_start_ratio", "band_share", "late_reward_slope", "hard_avg_at_k", "hard_pass_at_k",
            "hard_greedy_accuracy", "late_response_length")


def ordered_benches(names) -> list[str]:
    """Bench names in the order aime24, aime25, amc23, math500, then the others sorted."""
    names = set(names)
    return [b for b in BENCH_ORDER if b in names] + sorted(names - set(BENCH_ORDER))


def bench_measures(summary: dict) -> dict:
    """The comparison's numbers from one ``stare eval`` summary.json: k, the metrics the comparison shows
    (``stare.eval.metrics.compared``: per benchmark under their keys, pooled under their ``compare_name``), the
    headline metric's interval and the model."""
    bench = compared("bench")
    ci = (summary.get("ci95") or {}).get(bench[0].key) or [None, None]
    return {"k": summary.get("k"), **{m.key: num(summary.get(m.key)) for m in bench},
            "ci_low": num(ci[0]), "ci_high": num(ci[1]),
            **{m.compare_name: num(summary.get(m.key)) for m in compared("pooled")}, "model": summary.get("model")}


def summarise_benches(evals: list[dict]) -> dict:
    """bench -> {"k", the key of each metric compared per benchmark (avg_at_k, pass_at_k) and the compare_name of
    each pooled one (reflection) (each mean/std/n over the runs that have the bench), "ci95" (the headline metric's
    bootstrap interval, only when one run has it)} over several runs' ``bench -> summary`` maps."""
    names = [m.key for m in compared("bench")] + [m.compare_name for m in compared("pooled")]
    out = {}
    for b in ordered_benches({b for e in evals for b in e}):
        cells = [bench_measures(e[b]) for e in evals if b in e]
        ks = list(dict.fromkeys(c["k"] for c in cells if c["k"] is not None))
        one = cells[0] if len(cells) == 1 else None
        out[b] = {"k": ks[0] if len(ks) == 1 else "/".join(map(str, ks)) or None,
                  **{name: aggregate([c[name] for c in cells]) for name in names},
                  "ci95": [one["ci_low"], one["ci_high"]] if one and one["ci_low"] is not None else None}
    return out


def aggregate(values: list[float | None]) -> dict:
    """Mean, sample std (None for one value) and count of the values that are not None."""
    present = [v for v in values if v is not None]
    return {"mean": mean(present), "std": statistics.stdev(present) if len(present) > 1 else None,
            "n": len(present)}


def common_k(runs: list[Run]) -> int | None:
    ks = {r.eval["k"] for r in runs if r.eval}
    if len(ks) > 1:
        raise ValueError(f"the runs were evaluated with different k ({', '.join(map(str, sorted(ks)))}); "
                         "avg@k and pass@k are comparable only for one k")
    return ks.pop() if ks else None


def curve_measures(points: dict[int, dict]) -> dict:
    """One run's curve: its points by step, the best value (the first step reaching it) and the last step's."""
    pts = [{"step": s, **points[s]} for s in sorted(points) if points[s]["value"] is not None]
    if not pts:
        return {"points": [], "best": None, "best_step": None, "last": None, "last_step": None}
    best = max(pts, key=lambda p: p["value"])  # max() keeps the first of equal values: the earliest step
    return {"points": pts, "best": best["value"], "best_step": best["step"], "last": pts[-1]["value"],
            "last_step": pts[-1]["step"]}


def summarise_curves(runs: list[Run]) -> dict:
    """curve key -> {"label", "best", "last" (each mean/std/n over the runs that have the curve), "best_step",
    "last_step" (shared, or "/"-joined), "runs": [{"path", "seed", "points", "best", "best_step", "last",
    "last_step"}]} over one arm's runs."""
    out = {}
    for key in sorted({key for r in runs for key in r.curves}):
        per_run = [{"path": str(r.path), "seed": r.seed, **curve_measures(r.curves[key]["points"])}
                   for r in runs if key in r.curves]
        label = next(r.curves[key]["label"] for r in runs if key in r.curves)

        def shared(name):
            distinct = list(dict.fromkeys(p[name] for p in per_run if p[name] is not None))
            return distinct[0] if len(distinct) == 1 else "/".join(map(str, distinct)) or None

        out[key] = {"label": label, "best": aggregate([p["best"] for p in per_run]),
                    "last": aggregate([p["last"] for p in per_run]), "best_step": shared("best_step"),
                    "last_step": shared("last_step"), "runs": per_run}
    return out


def summarise_arm(runs: list[Run]) -> dict:
    """One arm's seeds: each run's measures and, per measure, mean, sample std and count over the seeds.

    Returns ``{"arm", "n_seeds", "seeds", "k", "metrics": {measure: {"mean", "std", "n"}}, "telemetry": {...},
    "benches", "runs": [...]}``; the measures are named as in ``MEASURES`` (``avg_at_k`` etc., with ``k`` given
    separately), the telemetry as in ``TELEMETRY`` (each run's step mean, then mean/std/n over the seeds).
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
    k = common_k(runs)
    per_run = []
    for r in runs:
        planned = (r.config.get("settings") or {}).get("steps")
        per_run.append({"path": str(r.path), "seed": r.seed, "steps": r.metrics[-1]["step"],
                        "planned_steps": planned, "has_eval": r.eval is not None, **run_measures(r),
                        "telemetry": run_telemetry(r)})
    return {
        "arm": runs[0].algo,
        "n_seeds": len(runs),
        "seeds": seeds,
        "k": k,
        "metrics": {name: aggregate([p[name] for p in per_run]) for name in MEASURES},
        "telemetry": {name: aggregate([p["telemetry"][name] for p in per_run]) for name in TELEMETRY},
        "benches": summarise_benches([r.evals for r in runs]),
        "curves": summarise_curves(runs),
        "runs": per_run,
    }
