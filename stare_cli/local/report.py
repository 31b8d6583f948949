"""The report of a local comparison: one table and three plots from the arms' run directories.

A run directory (one algorithm, one seed) holds ``config.yaml`` (the resolved settings), ``metrics.jsonl`` (one
JSON object per RL step) and, once the run has finished, ``eval.json`` (held-out avg@k, pass@k, greedy accuracy,
overall and on the hard cases, and the warm start's numbers before RL).

Reading order of this module:

1. ``load_run``: one run directory -> ``Run``;
2. per-run measures (final reward, start and late-run entropy, band share, late reward slope, held-out
   numbers) and ``summarise_arm``: the measures of one arm's seeds, with their mean, sample std and count;
3. ``permutation_test``: one-sided permutation test of mean(a) > mean(b);
4. ``write_comparison``: ``comparison.md``, ``comparison.csv`` and ``comparison.json``;
5. ``plot_curves``: ``entropy.png``, ``reward.png`` and ``response_length.png``.

A measure that cannot be computed (no eval.json, a key the metrics never logged, one seed for a std) is None
and is written as a blank cell; it is never replaced by 0.
"""
from __future__ import annotations

import csv
import itertools
import json
import math
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from stare.algorithms import upgrade_metric_names

# Windows over the end of a run, in percent of its recorded steps (at least one step each).
FINAL_PCT = 10  # final reward
LATE_PCT = 25  # late-run entropy and band share
SLOPE_PCT = 50  # late reward slope
SMOOTH = 5  # trailing moving average of the plotted curves, in steps
EXACT_LIMIT = 200_000  # permutation test: enumerate every split up to this many, else sample this many


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
    start = _num(m[0].get("stare/entropy"))
    late_h = _values(late, "stare/entropy")
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


# ---- 3. permutation test ----------------------------------------------------------------------------------------
def permutation_test(a: list[float], b: list[float]) -> float:
    """One-sided permutation p-value for mean(a) > mean(b).

    The share of the ways of splitting a + b into groups of len(a) and len(b) whose first group's sum is at least
    sum(a) (the observed split counts). Every split is enumerated when there are at most 200000 of them; beyond
    that 200000 random permutations (fixed seed) give (hits + 1) / (200000 + 1).
    """
    a, b = [float(x) for x in a], [float(x) for x in b]
    if not a or not b:
        raise ValueError("permutation_test needs at least one value in each group")
    pool = a + b
    observed = sum(a)
    tol = 1e-12 * max(1.0, sum(abs(x) for x in pool))  # equal sums added in another order still count
    n, na = len(pool), len(a)
    total = math.comb(n, na)
    if total <= EXACT_LIMIT:
        hits = sum(sum(pool[i] for i in idx) >= observed - tol for idx in itertools.combinations(range(n), na))
        return hits / total
    rng = np.random.default_rng(0)
    arr = np.asarray(pool)
    hits, done = 0, 0
    while done < EXACT_LIMIT:
        chunk = min(10_000, EXACT_LIMIT - done)
        perms = rng.permuted(np.tile(arr, (chunk, 1)), axis=1)
        hits += int((perms[:, :na].sum(axis=1) >= observed - tol).sum())
        done += chunk
    return (hits + 1) / (EXACT_LIMIT + 1)


# ---- 4. the comparison table ------------------------------------------------------------------------------------
def _group(runs: list[Run]) -> dict[str, list[Run]]:
    arms: dict[str, list[Run]] = {}
    for r in runs:  # first-seen order
        arms.setdefault(r.algo, []).append(r)
    return arms


def _common(values):
    """The value all of them share, or the distinct values joined with '/' (None when there are none)."""
    distinct = list(dict.fromkeys(v for v in values if v is not None))
    if len(distinct) == 1:
        return distinct[0]
    return "/".join(map(str, distinct)) if distinct else None


def _reference_band(runs: list[Run]) -> tuple[float, float] | None:
    """The band of the first arm with a band controller, else of the first run that names one."""
    banded = [r for r in runs if r.config["algo"].get("stare") and r.config["algo"].get("controller") == "band"]
    for r in banded + runs:
        if _band(r):
            return _band(r)
    return None


def _warmstart(runs: list[Run], k: int | None) -> dict | None:
    """The warm start's held-out numbers, one per seed (every arm of a seed starts from the same warm start)."""
    by_seed: dict = {}
    for r in runs:
        if r.eval and isinstance(r.eval.get("warmstart"), dict):
            by_seed.setdefault(r.seed, r.eval["warmstart"])
    if not by_seed:
        return None
    per_seed = []
    for ws in by_seed.values():
        numbers = _held_out(ws, ws.get("k", k))
        hard = _held_out(ws.get("hard"), ws.get("k", k))
        numbers.update({"hard_avg_at_k": hard["avg_at_k"], "hard_pass_at_k": hard["pass_at_k"]})
        per_seed.append(numbers)
    return {"n_seeds": len(per_seed), "seeds": list(by_seed),
            "metrics": {name: _aggregate([p[name] for p in per_seed]) for name in per_seed[0]}}


def _fmt(x: float | None, signed: bool = False) -> str:
    if x is None:
        return ""
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def _cell(agg: dict | None, n_seeds: int, signed: bool = False) -> str:
    """``mean ± std`` (``mean`` alone for one value), with ``(n=…)`` when some seeds lack the measure."""
    if not agg or agg["mean"] is None:
        return ""
    text = _fmt(agg["mean"], signed)
    if agg["std"] is not None:
        text += f" ± {_fmt(agg['std'])}"
    if agg["n"] < n_seeds:
        text += f" (n={agg['n']})"
    return text


def write_comparison(out_dir, runs: list[Run], *, baseline: str = "dapo") -> dict:
    """Write comparison.md, comparison.csv and comparison.json in ``out_dir``; returns the summary dict.

    One row per arm (runs grouped by algorithm in first-seen order), after a warm-start row when the runs'
    eval.json files carry the warm start's numbers. With hard-case results, each arm's per-seed hard pass@k is
    tested against ``baseline``'s (one-sided exact permutation test; both arms need two seeds or more).
    """
    if not runs:
        raise ValueError("write_comparison needs at least one run")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    k = _common_k(runs)
    arms = [summarise_arm(group) for group in _group(runs).values()]
    settings = [r.config.get("settings") or {} for r in runs]
    band = _reference_band(runs)
    has_hard = any(a["metrics"]["hard_pass_at_k"]["n"] or a["metrics"]["hard_avg_at_k"]["n"] for a in arms)
    base = next((a for a in arms if a["arm"] == baseline), None)
    test_name = f"one-sided exact permutation test on per-seed hard-case pass@k vs {baseline}"

    # p-values: each arm's per-seed hard pass@k against the baseline's
    def hard_pass(arm: dict) -> list[float]:
        return [p["hard_pass_at_k"] for p in arm["runs"] if p["hard_pass_at_k"] is not None]

    tested_sizes = set()
    for arm in arms:
        arm["p_hard_pass_vs_baseline"] = None
        if base is not None and arm is not base and len(hard_pass(arm)) >= 2 and len(hard_pass(base)) >= 2:
            arm["p_hard_pass_vs_baseline"] = permutation_test(hard_pass(arm), hard_pass(base))
            tested_sizes.add((len(hard_pass(arm)), len(hard_pass(base))))
    show_p = has_hard and base is not None

    notes = []
    if tested_sizes:
        smallest = ", ".join(f"{1 / math.comb(na + nb, na):.3g} for {na} vs {nb} seeds"
                             for na, nb in sorted(tested_sizes))
        notes.append(f"p: {test_name} (smallest attainable p: {smallest}).")
    elif has_hard:
        why = f"no baseline arm {baseline!r}" if base is None else "each arm needs two seeds or more with results"
        notes.append(f"No p-values ({test_name}): {why}.")
    for arm in arms:
        for p in arm["runs"]:
            if not p["has_eval"]:
                notes.append(f"{p['path']}: no eval.json (interrupted?); its held-out cells are blank.")
            if isinstance(p["planned_steps"], int) and p["steps"] < p["planned_steps"]:
                notes.append(f"{p['path']}: stopped at step {p['steps']} of {p['planned_steps']}.")
    if any(_band(r) != band for r in runs):
        notes.append("The arms' configs name different entropy bands; each band share uses its own arm's band.")

    summary = {
        "preset": _common(r.config.get("preset") for r in runs),
        "task": _common(s.get("task") for s in settings),
        "steps": _common(s.get("steps") for s in settings),
        "k": k,
        "band": list(band) if band else None,
        "baseline": baseline,
        "test": test_name if tested_sizes else None,
        "warmstart": _warmstart(runs, k),
        "arms": arms,
        "notes": notes,
    }

    # columns: (measure, md header, csv name, signed)
    # labels name k: the evaluated one, else the configs' eval_k (an arm without eval.json has blank cells anyway)
    kk = str(k if k is not None else _common(s.get("eval_k") for s in settings) or "k")
    columns = [("final_reward", "final reward", "final_reward", False),
               ("avg_at_k", f"avg@{kk}", f"avg_at_{kk}", False),
               ("pass_at_k", f"pass@{kk}", f"pass_at_{kk}", False),
               ("greedy_accuracy", "greedy", "greedy_accuracy", False),
               ("start_entropy", "start H", "start_entropy", False),
               ("late_entropy", "late H", "late_entropy", False),
               ("late_start_ratio", "late/start H", "late_start_ratio", False),
               ("band_share", "band share", "band_share", False),
               ("late_reward_slope", "reward slope /100 steps", "late_reward_slope_per_100", True)]
    if has_hard:
        columns += [("hard_avg_at_k", f"hard avg@{kk}", f"hard_avg_at_{kk}", False),
                    ("hard_pass_at_k", f"hard pass@{kk}", f"hard_pass_at_{kk}", False)]
    p_col = f"p hard pass@{kk} vs {baseline}"
    ws = summary["warmstart"]
    rows = ([("warm start (before RL)", "warmstart", ws["n_seeds"], ws["metrics"], None)] if ws else []) + \
           [(a["arm"], a["arm"], a["n_seeds"], a["metrics"], a["p_hard_pass_vs_baseline"]) for a in arms]

    # comparison.md
    seeds = _common(a["n_seeds"] for a in arms)
    header = (f"preset {summary['preset']}, task {summary['task']}, {summary['steps']} steps, {seeds} seed(s) per "
              f"arm, held-out k = {kk}, target entropy band "
              + (f"[{band[0]:.2f}, {band[1]:.2f}]" if band else "(none)"))
    titles = ["arm", "seeds"] + [c[1] for c in columns] + ([p_col] if show_p else [])
    md = ["# Comparison", "", header, "",
          "| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    for label, _, n, metrics, p in rows:
        cells = [label, str(n)] + [_cell(metrics.get(c[0]), n, c[3]) for c in columns]
        md.append("| " + " | ".join(cells + ([_fmt(p)] if show_p else [])) + " |")
    md += ["", f"final reward: mean reward over the last {FINAL_PCT}% of steps; late H and band share: the last "
           f"{LATE_PCT}% of steps; reward slope: least squares over the last {SLOPE_PCT}% of steps; "
           "held-out numbers from eval.json; mean ± sample std over seeds."]
    md += ([""] + [f"- {n}" for n in notes]) if notes else []
    (out_dir / "comparison.md").write_text("\n".join(md) + "\n")

    # comparison.csv
    fields = ["arm", "seeds"] + [f"{c[2]}_{s}" for c in columns for s in ("mean", "std")] + \
             ([f"p_hard_pass_at_{kk}_vs_{baseline}"] if show_p else [])
    with open(out_dir / "comparison.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        for _, name, n, metrics, p in rows:
            cells = [name, n]
            for c in columns:
                agg = metrics.get(c[0]) or {}
                cells += ["" if agg.get(s) is None else repr(agg[s]) for s in ("mean", "std")]
            writer.writerow(cells + ([("" if p is None else repr(p))] if show_p else []))

    (out_dir / "comparison.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# ---- 5. curves --------------------------------------------------------------------------------------------------
def _smoothed(run: Run, key: str) -> dict[int, float]:
    """step -> trailing mean of the last ``SMOOTH`` logged values of ``key`` (steps without the key skipped)."""
    pts = [(r["step"], v) for r in run.metrics if (v := _num(r.get(key))) is not None]
    out = {}
    for i, (step, _) in enumerate(pts):
        window = [v for _, v in pts[max(0, i - SMOOTH + 1):i + 1]]
        out[step] = sum(window) / len(window)
    return out


CURVES = (("stare/entropy", "mean token entropy", "entropy.png"),
          ("reward_mean", "mean reward", "reward.png"),
          ("response_length", "mean response length (tokens)", "response_length.png"))


def plot_curves(out_dir, runs: list[Run], curves=CURVES) -> list[Path]:
    """Write entropy.png, reward.png and response_length.png (or ``curves``: (metric key, axis label, file name)
    triples) in ``out_dir``; returns their paths.

    One line per arm: the mean over seeds of each seed's trailing 5-step mean, with a light min..max band over
    the seeds when there are several; the target entropy band is shaded on entropy.png.
    """
    import matplotlib
    # the Agg backend, set on each figure: no display needed, and pyplot's global backend is left alone
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    arms = _group(runs)
    palette = matplotlib.colormaps["tab10"].colors
    colours = {name: palette[i % len(palette)] for i, name in enumerate(arms)}  # the same in every plot
    band = _reference_band(runs)
    preset = _common(r.config.get("preset") for r in runs)
    task = _common((r.config.get("settings") or {}).get("task") for r in runs)
    written = []
    for key, label, filename in curves:
        fig = Figure(figsize=(7, 4), dpi=110)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        if key == "stare/entropy" and band:
            ax.axhspan(band[0], band[1], color="0.5", alpha=0.15, lw=0,
                       label=f"target band [{band[0]:.2f}, {band[1]:.2f}]")
        drawn = False
        for name, group in arms.items():
            curves = [c for c in (_smoothed(r, key) for r in group) if c]
            if not curves:
                continue
            steps = sorted(set().union(*curves))
            at = [[c[s] for c in curves if s in c] for s in steps]
            ax.plot(steps, [sum(v) / len(v) for v in at], color=colours[name], lw=1.6,
                    label=name if len(curves) == 1 else f"{name} ({len(curves)} seeds)")
            if len(curves) > 1:
                ax.fill_between(steps, [min(v) for v in at], [max(v) for v in at], color=colours[name],
                                alpha=0.18, lw=0)
            drawn = True
        if not drawn:
            ax.text(0.5, 0.5, f"no {key} in the metrics", transform=ax.transAxes, ha="center", va="center")
        ax.set_xlabel("RL step")
        ax.set_ylabel(label)
        ax.set_title(f"{label[0].upper() + label[1:]} ({preset}, {task}; trailing {SMOOTH}-step mean)", fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path)
        written.append(path)
    return written
