"""The comparison table, one definition for ``stare run`` and ``stare compare``: ``comparison.md``,
``comparison.csv`` and ``comparison.json`` from run records (``runs.Run``) and evaluation outputs.

Rows: a warm-start row when the runs' eval.json files carry the warm start's numbers, then one row per arm.
An arm is the runs of one algorithm that differ only in their seed (same preset, settings and algorithm
settings; a repeat of a seed is an arm of its own); its cells are mean ± sample std over the seeds. Two arms
of one algorithm are labelled with their folders. Arms come in the registry's order
(``stare algos``: grpo, dr-grpo, dapo, stare, stare-c2, stare-phi), then runs without a known algorithm
(OpenRLHF logs without a config.yaml), then evaluations that belong to no run given, one row per model.
The row order does not depend on the order the folders were named in, so both commands write the same table.

Columns: arm, seeds, final reward (last ``FINAL_PCT``% of steps), held-out avg@k, pass@k and greedy accuracy
(eval.json), start H (first step), late H, late/start H and band share (last ``LATE_PCT``% of steps), reward
slope (least squares over the last ``SLOPE_PCT``% of steps); then, when there are hard cases, hard avg@k and
pass@k and the permutation-test p against the baseline; then, when any row has ``stare eval`` outputs, avg@k
(with its 95% interval for one run) and pass@k per benchmark and reflection words per 1k tokens (the metrics
``stare.eval.metrics.METRICS`` marks for the comparison: ``compared("bench")``, ``compared("pooled")``); then,
when any run has an accuracy-over-training curve (``runs.Run.curves``), its best and its last point per
curve (``<key>_best_*``, ``<key>_last_*`` in the CSV, with their steps). The CSV also has the late response length. A value that cannot be computed is a blank cell, never 0.

When any run logged the selection telemetry (``runs.TELEMETRY_COLUMNS``: gate-on share, mean weight, the Phi > 0
shares of the boosted and lowered tokens, masked and penalised shares, the entropy forecast with and without the
weights; and a column for each number a token rule declares, shown where some arm logged it), comparison.md ends with a second table, "Selection telemetry", one row per arm, and each arm in
comparison.json has the same numbers under ``telemetry`` (per run under ``runs[i]["telemetry"]``).
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

from stare.eval.metrics import compared, permutation_test

from . import dose_response
from .arms import arm_labels, arm_sweep, common, group_arms, reference_band
from .runs import (FINAL_PCT, LATE_PCT, SLOPE_PCT, TELEMETRY_COLUMNS, Run, aggregate, common_k, held_out,
                   ordered_benches, run_band, summarise_arm, summarise_benches)
from .seeds import DEFAULT_BASELINES, SEED_MEASURES, default_baseline, find_baseline, seed_tests

# what runs may differ in and still be compared as like for like: the seed (the arms' replicates), and what a resume
# may change (rundir.RESUMABLE_CHANGES: where it computes, what stare run does around it, which policies it keeps)
_NOT_COMPARED = ("seed", "device", "ray_dashboard", "keep_checkpoint_every", "algos", "seeds", "benches",
                 "eval_protocol")


def setting_differences(runs: list[Run], groups: list[list[Run]]) -> list[tuple[str, list]]:
    """(key, its distinct values) for the preset and every run setting on which the runs differ, in key order:
    steps, a learning rate, a task. The seed, what a resume may change (``_NOT_COMPARED``) and a swept arm's swept
    keys (``stare run --sweep``: they differ by design) are not counted; runs without settings (OpenRLHF logs
    without a config.yaml) are left out."""
    swept = {key for g in groups for key in ((arm_sweep(g) or ("", {}))[1])}
    configs = [r.config for r in runs if r.config.get("settings")]
    keys = {"preset"} | {k for c in configs for k in c["settings"]}
    out = []
    for key in sorted(keys - set(_NOT_COMPARED) - swept):
        values = [c.get("preset") if key == "preset" else c["settings"].get(key) for c in configs]
        distinct = list(dict.fromkeys(json.dumps(v, sort_keys=True, default=str) for v in values))
        if len(distinct) > 1:
            out.append((key, [json.loads(v) for v in distinct]))
    return out


def _warmstart(runs: list[Run], k: int | None) -> dict | None:
    """The warm start's held-out numbers, one per seed (every arm of a seed starts from the same warm start)."""
    by_seed: dict = {}
    for r in runs:
        if r.eval and isinstance(r.eval.get("warmstart"), dict):
            by_seed.setdefault((r.config.get("preset"), r.seed), r.eval["warmstart"])
    if not by_seed:
        return None
    per_seed = []
    for ws in by_seed.values():
        numbers = held_out(ws, ws.get("k", k))
        hard = held_out(ws.get("hard"), ws.get("k", k))
        numbers.update({"hard_avg_at_k": hard["avg_at_k"], "hard_pass_at_k": hard["pass_at_k"]})
        per_seed.append(numbers)
    return {"n_seeds": len(per_seed), "seeds": [seed for _, seed in by_seed],
            "metrics": {name: aggregate([p[name] for p in per_seed]) for name in per_seed[0]}}


def _fmt(x: float | None, signed: bool = False, digits: int = 3, scientific: bool = False) -> str:
    if x is None:
        return ""
    return f"{x:{'+' if signed else ''}.{digits}{'e' if scientific else 'f'}}"


def _cell(agg: dict | None, n_seeds: int, signed: bool = False, digits: int = 3, scientific: bool = False) -> str:
    """``mean ± std`` (``mean`` alone for one value), with ``(n=…)`` when some seeds lack the measure."""
    if not agg or agg["mean"] is None:
        return ""
    text = _fmt(agg["mean"], signed, digits, scientific)
    if agg["std"] is not None:
        text += f" ± {_fmt(agg['std'], digits=digits, scientific=scientific)}"
    if agg["n"] < n_seeds:
        text += f" (n={agg['n']})"
    return text


def _bench_cell(cell: dict | None, n_seeds: int) -> str:
    """The headline metric (avg@k) with its 95% bootstrap interval (one run) or ± std (several), and k."""
    head = compared("bench")[0].key
    if not cell or cell[head]["mean"] is None:
        return ""
    text = _cell(cell[head], n_seeds)
    if cell["ci95"]:
        text += f" [{_fmt(cell['ci95'][0])}, {_fmt(cell['ci95'][1])}]"
    return text + f" (k={cell['k']})"


def _curve_cell(curve: dict | None, which: str, n_seeds: int) -> str:
    """A curve's best or last point: ``value (step S)`` for one run, ``mean ± std (step S/T)`` over seeds."""
    if not curve or curve[which]["mean"] is None:
        return ""
    return _cell(curve[which], n_seeds) + f" (step {curve[f'{which}_step']})"


def _telemetry_md(arms: list[dict]) -> list[str]:
    """The "Selection telemetry" section of comparison.md (no lines when no arm logged any of it)."""
    if not any(agg["n"] for a in arms for agg in a["telemetry"].values()):
        return []
    logged = {name for a in arms for name, agg in a["telemetry"].items() if agg["n"]}
    columns = [c for c in TELEMETRY_COLUMNS if c.rule is None or c.name in logged]  # a rule's own: where logged
    titles = ["arm", "seeds"] + [c.header for c in columns]
    md = ["", "## Selection telemetry", "", "| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    for a in arms:
        cells = [a["label"], str(a["n_seeds"])] + [_cell(a["telemetry"][c.name], a["n_seeds"], signed=c.signed,
                                                         digits=c.digits, scientific=c.signed) for c in columns]
        md.append("| " + " | ".join(cells) + " |")
    md += ["", "Each run's mean over the steps that logged the metric (blank: never logged), then mean ± sample std "
           "over seeds. gate on: share of steps with the entropy gate on (`stare/gate_on`); mean weight: mean token "
           "weight; boosted / lowered Phi>0: of the tokens with weight > 1 / with weight < 1 or a KL-Cov penalty, "
           "the share with Phi > 0 (entropy-raising); masked: share of tokens whose gradient is dropped; penalised: "
           "share with a KL-Cov penalty; forecast / forecast unweighted: first-order entropy change per unit step, "
           "token mean of w A Phi / of A Phi (`stare/entropy_forecast`, `stare/entropy_forecast_base`)." +
           "".join(f" {c.header} ({c.rule}): {c.meaning} (`{c.key}`)." for c in columns if c.rule)]
    return md


def _fmt_p(p: float | None) -> str:
    """A p-value: three decimals, or two significant digits below 0.001 (8 seeds against 8 reach 7.8e-5)."""
    return "" if p is None else (f"{p:.2g}" if p < 0.001 else f"{p:.3f}")


def _seed_md(rows: list[dict], baseline: str, kk: str) -> list[str]:
    """The seed table: 95% intervals and permutation p-values against the baseline (blank under two seeds)."""
    if not any(r["n_seeds"] >= 2 for r in rows):
        return []
    titles = ["arm", "seeds"]
    for _, header in SEED_MEASURES:
        header = header.replace("@k", f"@{kk}")
        titles += [f"{header} 95% interval", f"p {header} > {baseline}", f"p {header} < {baseline}"]
    md = ["", "Over seeds: each measure's 95% interval of the mean (t, from the sample std, clipped to the "
          "measure's range: [0, 1] for avg@k and band share, >= 0 for late H), and one-sided exact permutation tests "
          f"of the per-seed values against {baseline} (p > : this arm higher; p < : lower).", "",
          "| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    for r in rows:
        cells = [r["label"], str(r["n_seeds"])]
        for measure, _ in SEED_MEASURES:
            c = r[measure]
            ci = c["ci95"]
            cells += ["" if ci is None else f"[{_fmt(ci[0])}, {_fmt(ci[1])}]", _fmt_p(c["p_higher"]),
                      _fmt_p(c["p_lower"])]
        md.append("| " + " | ".join(cells) + " |")
    return md


DEFAULT_BASELINE = DEFAULT_BASELINES[0]


@dataclass
class Comparison:
    """The comparison as data: ``summary`` is comparison.json; the rest is the table's layout, shared by the
    markdown and the CSV writer."""
    summary: dict
    columns: list  # (measure, md header, csv name, signed, shown in the markdown)
    rows: list  # (md label, csv name, seeds, metrics, p, benches), the warm start's row first when there is one
    row_curves: list  # per row: curve key -> its best and last points
    benches: list
    bench_metrics: list
    pooled: list
    curve_keys: list
    curve_labels: dict
    kk: str  # k as the headers name it
    show_p: bool
    p_col: str
    band: tuple | None


def _pooled_cell(m, bench_cells: dict) -> dict | None:
    """A pooled metric's cell: the first bench (in bench order) that measured it."""
    return next((c[m.compare_name] for c in bench_cells.values() if c[m.compare_name]["n"]), None)


def build_comparison(runs: list[Run], *, baseline: str | None = None, evals: list[dict] = (),
                     require_baseline: bool = False, notes: list[str] = ()) -> Comparison:
    """The comparison as data, before any file is written; the arguments are ``write_comparison``'s."""
    if not runs and not evals:
        raise ValueError("write_comparison needs at least one run or evaluation")
    k = common_k(runs)
    groups = group_arms(runs)
    arms = [summarise_arm(group) for group in groups]
    for arm, label, group in zip(arms, arm_labels(groups), groups):
        arm["label"] = label
        swept = arm_sweep(group)
        arm["sweep"] = swept[1] if swept else None  # {key: value} of an arm of stare run --sweep
    by_model: dict[str, list[dict]] = {}
    for s in evals:  # evaluations of one model, one bench each
        by_model.setdefault(str(s.get("model")), []).append(s)
    eval_rows = [{"label": model, "model": model, "benches": summarise_benches([{s["bench"]: s} for s in group])}
                 for model, group in by_model.items()]
    for row in eval_rows:  # several evaluations of one model on one bench would be averaged: keep the last
        row["benches"] = summarise_benches([{s["bench"]: s for s in by_model[row["model"]]}])
    settings = [r.config.get("settings") or {} for r in runs]
    band = reference_band(runs)
    has_hard = any(a["metrics"]["hard_pass_at_k"]["n"] or a["metrics"]["hard_avg_at_k"]["n"] for a in arms)
    notes = list(notes)
    if baseline is None:  # dapo, else grpo, else the first arm (default_baseline), said in the notes
        base = default_baseline(arms)
        baseline = base["label"] if base is not None else DEFAULT_BASELINE
        if base is not None and base["arm"] != DEFAULT_BASELINE:
            notes.append(f"Baseline of the tests: {baseline} (there is no {DEFAULT_BASELINE} arm; --baseline names "
                         "another).")
    else:
        base = find_baseline(arms, baseline)
    if base is None and require_baseline:
        raise ValueError(f"--baseline {baseline!r}: no arm of that name, label or folder here; the arms are: "
                         + ", ".join(a["label"] for a in arms))
    differences = setting_differences(runs, groups)
    warnings = [w for r in runs for w in r.warnings]
    if differences:
        said = "; ".join(f"{key} " + ", ".join(map(str, values)) for key, values in differences)
        warnings.append(f"the compared runs differ in more than algorithm and seed ({said}): their intervals and "
                        "p-values set runs trained differently side by side")
    notes += [f"Warning: {w}." for w in warnings]
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

    if tested_sizes:
        smallest = ", ".join(f"{1 / math.comb(na + nb, na):.3g} for {na} vs {nb} seeds"
                             for na, nb in sorted(tested_sizes))
        notes.append(f"p: {test_name} (smallest attainable p: {smallest}).")
    elif has_hard:
        why = f"no baseline arm {baseline!r}" if base is None else "each arm needs two seeds or more with results"
        notes.append(f"No p-values ({test_name}): {why}.")
    local = {str(r.path) for r in runs if r.config.get("backend") == "local"}  # runs that write eval.json
    for arm in arms:
        for p in arm["runs"]:
            if not p["has_eval"] and p["path"] in local:
                notes.append(f"{p['path']}: no eval.json (interrupted?); its held-out cells are blank.")
            if isinstance(p["planned_steps"], int) and p["steps"] < p["planned_steps"]:
                notes.append(f"{p['path']}: stopped at step {p['steps']} of {p['planned_steps']}.")
    if any(run_band(r) != band for r in runs if run_band(r)):
        notes.append("The arms' configs name different entropy bands; each band share uses its own arm's band.")

    summary = {
        "preset": common(r.config.get("preset") for r in runs),
        "task": common(s.get("task") for s in settings),
        "steps": common(s.get("steps") for s in settings),
        "k": k,
        "band": list(band) if band else None,
        "baseline": baseline,
        "test": test_name if tested_sizes else None,
        "warnings": warnings,
        "warmstart": _warmstart(runs, k),
        "arms": arms,
        "evals": eval_rows,
        "notes": notes,
    }
    summary["seed_tests"] = seed_tests(arms, base)
    summary["dose_response"] = dose_response.build(arms, groups)

    # columns: (measure, md header, csv name, signed, shown in the markdown)
    # labels name k: the evaluated one, else the configs' eval_k (an arm without eval.json has blank cells anyway)
    kk = str(k if k is not None else common(s.get("eval_k") for s in settings) or "k")
    columns = [("final_reward", "final reward", "final_reward", False, True),
               ("avg_at_k", f"avg@{kk}", f"avg_at_{kk}", False, True),
               ("pass_at_k", f"pass@{kk}", f"pass_at_{kk}", False, True),
               ("greedy_accuracy", "greedy", "greedy_accuracy", False, True),
               ("start_entropy", "start H", "start_entropy", False, True),
               ("late_entropy", "late H", "late_entropy", False, True),
               ("late_start_ratio", "late/start H", "late_start_ratio", False, True),
               ("band_share", "band share", "band_share", False, True),
               ("late_reward_slope", "reward slope /100 steps", "late_reward_slope_per_100", True, True)]
    if has_hard:
        columns += [("hard_avg_at_k", f"hard avg@{kk}", f"hard_avg_at_{kk}", False, True),
                    ("hard_pass_at_k", f"hard pass@{kk}", f"hard_pass_at_{kk}", False, True)]
    columns += [("late_response_length", "late response length", "late_response_length", False, False)]
    p_col = f"p hard pass@{kk} vs {baseline}"
    benches = ordered_benches({b for row in arms + eval_rows for b in row["benches"]})
    bench_metrics = compared("bench")  # per benchmark: avg@k (the headline, with its interval and k), pass@k
    # the pooled metrics (reflection words per 1k tokens) any row measured
    pooled = [m for m in compared("pooled")
              if any(c[m.compare_name]["n"] for row in arms + eval_rows for c in row["benches"].values())]

    # accuracy over training (Run.curves): the best and the last point of each curve, per arm
    curve_keys = sorted({key for a in arms for key in a["curves"]})
    curve_labels = {key: next(a["curves"][key]["label"] for a in arms if key in a["curves"]) for key in curve_keys}
    ws = summary["warmstart"]
    # (md label, csv name, seeds, metrics, p, benches)
    rows = ([("warm start (before RL)", "warmstart", ws["n_seeds"], ws["metrics"], None, {})] if ws else []) + \
           [(a["label"], a["label"], a["n_seeds"], a["metrics"], a["p_hard_pass_vs_baseline"], a["benches"])
            for a in arms] + \
           [(e["label"], e["label"], 1, {}, None, e["benches"]) for e in eval_rows]
    row_curves = ([{}] if ws else []) + [a["curves"] for a in arms] + [{} for _ in eval_rows]
    return Comparison(summary, columns, rows, row_curves, benches, bench_metrics, pooled, curve_keys, curve_labels, kk,
                      show_p, p_col, band)


def comparison_markdown(comp: Comparison) -> str:
    """comparison.md: the table, its notes, the seed table, the dose-response and the selection telemetry."""
    summary, columns, rows, row_curves = comp.summary, comp.columns, comp.rows, comp.row_curves
    benches, bench_metrics, pooled, curve_keys = comp.benches, comp.bench_metrics, comp.pooled, comp.curve_keys
    kk = comp.kk
    arms, notes, band, show_p, baseline = summary["arms"], summary["notes"], comp.band, comp.show_p, summary["baseline"]
    seeds = common(a["n_seeds"] for a in arms)
    header = (f"preset {summary['preset']}, task {summary['task']}, {summary['steps']} steps, {seeds} seed(s) per "
              f"arm, held-out k = {kk}, target entropy band "
              + (f"[{band[0]:.2f}, {band[1]:.2f}]" if band else "(none)"))
    shown = [c for c in columns if c[4]]
    titles = ["arm", "seeds"] + [c[1] for c in shown] + ([comp.p_col] if show_p else [])
    for b in benches:
        titles += [f"{b} {m.label('k')}" for m in bench_metrics]
    titles += [m.compare_header for m in pooled]
    titles += [f"{comp.curve_labels[key]} {which}" for key in curve_keys for which in ("best", "last")]
    md = ["# Comparison", "", header, "",
          "| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    for (label, _, n, metrics, p, bench_cells), curves in zip(rows, row_curves):
        cells = [label, str(n)] + [_cell(metrics.get(c[0]), n, c[3]) for c in shown] + ([_fmt_p(p)] if show_p else [])
        for b in benches:
            cell = bench_cells.get(b)
            cells += [_bench_cell(cell, n)] + [_cell(cell[m.key], n) if cell else "" for m in bench_metrics[1:]]
        cells += [_cell(_pooled_cell(m, bench_cells), n, digits=m.compare_digits) for m in pooled]
        cells += [_curve_cell(curves.get(key), which, n) for key in curve_keys for which in ("best", "last")]
        md.append("| " + " | ".join(cells) + " |")
    md += ["", f"final reward: mean reward over the last {FINAL_PCT}% of steps; late H and band share: the last "
           f"{LATE_PCT}% of steps; reward slope: least squares over the last {SLOPE_PCT}% of steps; "
           "held-out numbers from eval.json; mean ± sample std over seeds."]
    if benches:
        md += ["", "<bench> avg@k: `stare eval` of the run's final model (eval-<bench>/summary.json, or an "
               "evaluation whose model is the run's final/), with its 95% bootstrap interval over problems for "
               "one run, mean ± sample std over seeds for several."]
    if curve_keys:
        md += ["", "best / last: accuracy over training, each run's highest point (its first step) and its last "
               "point, mean ± sample std over seeds: (checkpoints) `stare eval --checkpoints` avg@k of the kept "
               "policies; (in training) the engine's own evaluation during training (local: `eval_every`; OpenRLHF: "
               "its eval/ pass1 logs). The curves: accuracy.png."]
    md += ([""] + [f"- {n}" for n in notes]) if notes else []
    md += _seed_md(summary["seed_tests"], baseline, kk)
    md += dose_response.markdown(summary["dose_response"], kk)
    md += _telemetry_md(arms)
    return "\n".join(md) + "\n"


def write_comparison_csv(comp: Comparison, path: Path) -> None:
    """comparison.csv: one row per table row, each measure as mean and std (and a benchmark's interval and k)."""
    summary, columns, rows, row_curves = comp.summary, comp.columns, comp.rows, comp.row_curves
    benches, bench_metrics, pooled, curve_keys = comp.benches, comp.bench_metrics, comp.pooled, comp.curve_keys
    kk, show_p, baseline = comp.kk, comp.show_p, summary["baseline"]
    fields = ["arm", "seeds"] + [f"{c[2]}_{s}" for c in columns for s in ("mean", "std")] + \
             ([f"p_hard_pass_at_{kk}_vs_{baseline}"] if show_p else [])
    for b in benches:  # the headline metric with its interval, the other bench metrics, k
        bench_fields = [f"{b}_{m.key}_{s}" for m in bench_metrics for s in ("mean", "std")]
        fields += bench_fields[:2] + [f"{b}_ci_low", f"{b}_ci_high"] + bench_fields[2:] + [f"{b}_k"]
    fields += [f"{m.key}_{s}" for m in pooled for s in ("mean", "std")]
    fields += [f"{key}_{which}_{s}" for key in curve_keys for which in ("best", "last") for s in ("mean", "std", "step")]

    def pair(agg: dict | None) -> list[str]:
        agg = agg or {}
        return ["" if agg.get(s) is None else repr(agg[s]) for s in ("mean", "std")]

    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        for (_, name, n, metrics, p, bench_cells), curves in zip(rows, row_curves):
            cells = [name, n]
            for c in columns:
                cells += pair(metrics.get(c[0]))
            cells += [("" if p is None else repr(p))] if show_p else []
            for b in benches:
                cell = bench_cells.get(b)
                if cell is None:
                    cells += [""] * (2 * len(bench_metrics) + 3)
                    continue
                ci = cell["ci95"] or ["", ""]
                cells += pair(cell[bench_metrics[0].key]) + ["" if v is None else repr(v) for v in ci]
                cells += [x for m in bench_metrics[1:] for x in pair(cell[m.key])]
                cells.append(cell["k"] if cell["k"] is not None else "")
            for m in pooled:
                cells += pair(_pooled_cell(m, bench_cells))
            for key in curve_keys:
                curve = curves.get(key)
                for which in ("best", "last"):
                    step = curve[f"{which}_step"] if curve else None
                    cells += pair(curve[which] if curve else None) + ["" if step is None else step]
            writer.writerow(cells)


def write_comparison(out_dir, runs: list[Run], *, baseline: str | None = None, evals: list[dict] = (),
                     require_baseline: bool = False, notes: list[str] = ()) -> dict:
    """Write comparison.md, comparison.csv and comparison.json in ``out_dir``; returns the summary dict.

    ``runs``: training runs (their ``evals`` already joined); ``evals``: summary.json dicts of evaluations that
    belong to none of the runs (one row per model). The rows and columns are those of the module docstring. The
    seed table, and with hard-case results each arm's per-seed hard pass@k, are tested against ``baseline``
    (``find_baseline``: an arm's label, its folder or an algorithm; one-sided exact permutation tests, both arms
    with two seeds or more); None: dapo's arm, else grpo's, else the first (``default_baseline``; a note says which
    when it is not dapo). With ``require_baseline`` a ``baseline`` that names no arm is a ValueError listing the
    arms, raised before anything is written; without it the tables simply have no p-values. ``notes``: lines the
    caller adds to the table's notes (first). Runs that differ in more than algorithm and seed
    (``setting_differences``) get a warning in the notes and in comparison.json's ``warnings``.
    """
    comp = build_comparison(runs, baseline=baseline, evals=evals, require_baseline=require_baseline, notes=notes)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "comparison.md").write_text(comparison_markdown(comp))
    write_comparison_csv(comp, out_dir / "comparison.csv")
    (out_dir / "comparison.json").write_text(json.dumps(comp.summary, indent=2) + "\n")
    return comp.summary
