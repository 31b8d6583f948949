"""``stare compare``: one table and one set of plots over training runs and evaluation outputs.

Inputs, each a folder:
- a training run (``config.yaml`` + ``metrics.jsonl``, as ``stare train`` / ``stare run`` write them); its
  evaluations are the ``eval-<bench>/summary.json`` folders inside it (``stare eval --out RUN`` makes them);
- an evaluation output (``summary.json``), shown as its own row;
- an OpenRLHF run: TensorBoard event files (``events.out.tfevents.*``, possibly in a subfolder named after the
  run), read with the tag mapping in ``stare.cli.tensorboard_runs.TB_TAGS``; its settings come from a
  ``config.yaml`` beside or above the event folder when there is one;
- a folder holding several runs (a ``stare run`` output, a TensorBoard log folder): every run below it.

One row per run: algorithm, model, avg@k (with its 95% interval) and pass@k per benchmark found, final
entropy, share of late steps in the target band, late response length, reflection rate. What a run does not
have stays blank. Plots: entropy, reward, response length and reflection rate against training step.
"""
from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

from stare.cli.local.report import (CURVES, FINAL_PCT, LATE_PCT, _band, _mean, _tail, _values, band_share, load_run,
                                    plot_curves)
from stare.cli.tensorboard_runs import event_dirs, load_tb_run, run_root

BENCH_ORDER = ("aime24", "aime25", "amc23", "math500")


def _is_run(path: Path) -> bool:
    return (path / "config.yaml").is_file() and (path / "metrics.jsonl").is_file()


def collect(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """(training run folders, standalone eval folders) named by ``paths``; ValueError for a folder with neither."""
    runs, evals = [], []
    for path in paths:
        if not path.is_dir():
            raise ValueError(f"{path} is not a folder")
        if _is_run(path):
            runs.append(path)
        elif (path / "summary.json").is_file():
            evals.append(path)
        else:
            found = sorted({p.parent for p in path.rglob("metrics.jsonl") if _is_run(p.parent)})
            found += [d for d in event_dirs(path) if not any(d == r or r in d.parents for r in found)]
            if not found:
                raise ValueError(f"{path} holds no training run (config.yaml + metrics.jsonl, or TensorBoard event "
                                 "files) and no evaluation (summary.json)")
            runs += found
    return runs, evals


def _read_summary(path: Path) -> dict:
    try:
        return json.loads((path / "summary.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path / 'summary.json'} is not readable JSON: {exc}") from None


def _bench_cells(summaries: list[dict]) -> dict:
    cells = {}
    for s in summaries:
        bench = s.get("bench")
        ci = (s.get("ci95") or {}).get("avg_at_k")
        cells[bench] = {"k": s.get("k"), "avg_at_k": s.get("avg_at_k"), "pass_at_k": s.get("pass_at_k"),
                        "ci_low": ci[0] if ci else None, "ci_high": ci[1] if ci else None,
                        "reflection": s.get("reflection_per_1k_tokens")}
    return cells


def compare(paths: list[Path], out: Path) -> list[dict]:
    run_dirs, eval_dirs = collect(paths)
    rows, runs = [], []
    for d in run_dirs:
        if _is_run(d):
            run, root = load_run(d), d
        else:  # TensorBoard event files (OpenRLHF)
            run, root = load_tb_run(d), run_root(d)
        label = f"{run.algo or 'openrlhf'} ({d})"
        runs.append(replace(run, algo=label))
        late = _tail(run.metrics, LATE_PCT)
        summaries = [_read_summary(e) for e in sorted(root.glob("eval-*")) if (e / "summary.json").is_file()]
        rows.append({"run": str(d), "algorithm": run.algo,
                     "model": (run.config.get("settings") or {}).get("model"),
                     "final_entropy": _mean(_values(_tail(run.metrics, FINAL_PCT), "stare/entropy")),
                     "band_share": band_share(_band(run), _values(late, "stare/entropy")),
                     "response_length": _mean(_values(late, "response_length")),
                     "benches": _bench_cells(summaries)})
    for e in eval_dirs:
        s = _read_summary(e)
        rows.append({"run": str(e), "algorithm": None, "model": s.get("model"), "final_entropy": None,
                     "band_share": None, "response_length": s.get("mean_response_tokens"),
                     "benches": _bench_cells([s])})
    write_tables(rows, out)
    if runs:
        plot_curves(out, runs, CURVES + (("reflection_rate", "reflection words per 1k tokens", "reflection.png"),))
    return rows


def _f(x, digits=3) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def write_tables(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    benches = [b for b in BENCH_ORDER if any(b in r["benches"] for r in rows)]
    benches += sorted({b for r in rows for b in r["benches"] if b not in benches and b})
    fields = ["run", "algorithm", "model"]
    for b in benches:
        fields += [f"{b}_avg_at_k", f"{b}_ci_low", f"{b}_ci_high", f"{b}_pass_at_k", f"{b}_k"]
    fields += ["final_entropy", "band_share", "response_length", "reflection_per_1k_tokens"]
    with open(out / "comparison.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for r in rows:
            line = [r["run"], r["algorithm"] or "", r["model"] or ""]
            for b in benches:
                c = r["benches"].get(b, {})
                line += [c.get("avg_at_k"), c.get("ci_low"), c.get("ci_high"), c.get("pass_at_k"), c.get("k")]
            refl = next((c["reflection"] for c in r["benches"].values() if c.get("reflection") is not None), None)
            line += [r["final_entropy"], r["band_share"], r["response_length"], refl]
            w.writerow(["" if v is None else v for v in line])
    head = ["run", "algorithm", "model"]
    for b in benches:
        head += [f"{b} avg@k [95% CI]", f"{b} pass@k"]
    head += ["final entropy", "band share", "response length", "reflection /1k tok"]
    md = ["# Comparison", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["run"], r["algorithm"] or "", r["model"] or ""]
        for b in benches:
            c = r["benches"].get(b)
            if c and c.get("avg_at_k") is not None:
                ci = f" [{_f(c['ci_low'])}, {_f(c['ci_high'])}]" if c.get("ci_low") is not None else ""
                cells += [f"{_f(c['avg_at_k'])}{ci} (k={c.get('k')})", _f(c.get("pass_at_k"))]
            else:
                cells += ["", ""]
        refl = next((c["reflection"] for c in r["benches"].values() if c.get("reflection") is not None), None)
        cells += [_f(r["final_entropy"]), _f(r["band_share"]), _f(r["response_length"], 1), _f(refl, 2)]
        md.append("| " + " | ".join(cells) + " |")
    md += ["", f"final entropy: mean over the last {FINAL_PCT}% of steps; band share and response length: the "
           f"last {LATE_PCT}% of steps; blank: not measured for that run."]
    (out / "comparison.md").write_text("\n".join(md) + "\n")
