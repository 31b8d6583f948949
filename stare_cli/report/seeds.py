"""Statistics over seeds: the 95% t interval of a mean over seeds (clipped to the measure's range), the baseline
arm, and the seed table's one-sided exact permutation tests of each arm's per-seed values against the baseline's."""
from __future__ import annotations

import math
from pathlib import Path

from stare.eval.metrics import permutation_test


# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (beyond: the normal's 1.96)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
# the measures the seed table tests against the baseline: (measure, header)
SEED_MEASURES = (("avg_at_k", "avg@k"), ("late_entropy", "late H"), ("band_share", "band share"))


# the values a measure can take, (low, high), None for no bound on that side: an interval of its mean is clipped to
# them (a share or an accuracy lies in [0, 1], an entropy is >= 0); a benchmark's avg@k ("<bench>_avg_at_k") too
MEASURE_RANGE = {"avg_at_k": (0.0, 1.0), "pass_at_k": (0.0, 1.0), "greedy_accuracy": (0.0, 1.0),
                 "band_share": (0.0, 1.0), "late_entropy": (0.0, None), "start_entropy": (0.0, None)}


def measure_range(measure: str) -> tuple[float | None, float | None]:
    """``MEASURE_RANGE`` of ``measure`` (a benchmark's ``<bench>_avg_at_k`` as avg@k); (None, None) when unknown."""
    if measure.endswith("_avg_at_k"):
        measure = "avg_at_k"
    return MEASURE_RANGE.get(measure, (None, None))


def t_interval(values: list[float], bounds: tuple[float | None, float | None] = (None, None)
               ) -> tuple[float, float] | None:
    """The 95% interval of the mean over seeds, mean -+ t(0.975, n - 1) s / sqrt(n), clipped to ``bounds`` (the
    measure's range, ``measure_range``: the mean lies in it, so the clipped interval covers it as often as the
    t interval does); None under two values."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * sd / math.sqrt(n)
    low, high = bounds
    return (mean - half if low is None else max(low, mean - half),
            mean + half if high is None else min(high, mean + half))


def _seed_values(arm: dict, measure: str) -> list[float]:
    return [p[measure] for p in arm["runs"] if p.get(measure) is not None]


DEFAULT_BASELINES = ("dapo", "grpo")  # the baseline when none is named: the first of these with an arm, else the first arm


def default_baseline(arms: list[dict]) -> dict | None:
    """The arm the tests compare against when ``--baseline`` is not given: dapo's, else grpo's (the first arm of
    each), else the first arm; None with fewer than two arms (nothing to test)."""
    if len(arms) < 2:
        return None
    for algo in DEFAULT_BASELINES:
        found = next((a for a in arms if a["arm"] == algo), None)
        if found is not None:
            return found
    return arms[0]


def find_baseline(arms: list[dict], baseline: str) -> dict | None:
    """The arm the tests compare against: the one labelled ``baseline`` (``stare (runs/x/stare)`` where two arms
    share an algorithm), or whose folder is ``baseline`` (the part of such a label in parentheses, or, where the
    label has none because its algorithm has one arm, the arm's folder: a seed's run folder, or the folder of an
    arm's seeds), else the first arm of algorithm ``baseline``; None when there is none."""
    for match in (lambda a: a.get("label") == baseline, lambda a: str(a.get("label", "")).endswith(f" ({baseline})"),
                  lambda a: _same_folder(baseline, a), lambda a: a["arm"] == baseline):
        found = next((a for a in arms if match(a)), None)
        if found is not None:
            return found
    return None


def _same_folder(folder: str, arm: dict) -> bool:
    """Whether ``folder`` is one of ``arm``'s run folders, or the one folder holding its seeds' runs."""
    paths = [Path(r["path"]) for r in arm.get("runs") or []]
    folders = set(paths) | ({paths[0].parent} if len(paths) > 1 and len({p.parent for p in paths}) == 1 else set())
    want = Path(folder).resolve()
    return any(f.resolve() == want for f in folders)


def seed_tests(arms: list[dict], base: dict | None) -> list[dict]:
    """Per arm and measure of SEED_MEASURES: the 95% interval over seeds and, against the arm ``base``
    (``find_baseline``; None: no tests; both with two seeds or more), the one-sided exact permutation p-values for
    "higher" and for "lower"."""
    out = []
    for arm in arms:
        row = {"label": arm["label"], "n_seeds": arm["n_seeds"]}
        for measure, _ in SEED_MEASURES:
            vals = _seed_values(arm, measure)
            row[measure] = {"ci95": t_interval(vals, measure_range(measure)), "p_higher": None, "p_lower": None}
            if base is not None and arm is not base:
                ref = _seed_values(base, measure)
                if len(vals) >= 2 and len(ref) >= 2:
                    row[measure]["p_higher"] = permutation_test(vals, ref)
                    row[measure]["p_lower"] = permutation_test([-v for v in vals], [-v for v in ref])
        out.append(row)
    return out
