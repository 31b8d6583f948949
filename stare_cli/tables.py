"""The comparison table: ``comparison.md``, ``comparison.csv`` and ``comparison.json`` from run records."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from stare.eval.metrics import permutation_test

from .runs import (FINAL_PCT, LATE_PCT, SLOPE_PCT, Run, _aggregate, _band, _common_k, _held_out, summarise_arm)


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
