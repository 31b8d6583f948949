"""``stare compare``: one table and one set of plots over training runs and evaluation outputs.

Inputs, each a folder:
- a training run (``config.yaml`` + ``metrics.jsonl``, as ``stare train`` / ``stare run`` write them); its
  evaluations are the ``eval-<bench>/summary.json`` folders inside it (``stare eval --out RUN`` makes them);
- an evaluation output (``summary.json``): joined to the run it evaluated when its model is that run's
  ``final/`` folder, else a row of its own (one per model);
- an OpenRLHF run: TensorBoard event files (``events.out.tfevents.*``, possibly in a subfolder named after the
  run), read with the tag mapping in ``tensorboard_runs.TB_TAGS``; its settings come from a
  ``config.yaml`` beside or above the event folder when there is one;
- a folder holding several runs (a ``stare run`` output, a TensorBoard log folder): every run below it.

The table and plots are ``stare run``'s (``tables.write_comparison``, ``plots.plot_curves``):
the same rows, columns, windows and colours, so both commands print the same numbers for the same runs.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from stare.cli.report.dose_response import plot as plot_dose_response
from stare.cli.report.plots import CURVES, plot_accuracy, plot_curves
from stare.cli.report.runs import load_run, read_checkpoint_curves, read_evals
from stare.cli.report.tables import write_comparison
from stare.cli.report.tensorboard_runs import event_dirs, load_tb_run, run_root
from stare.eval.summary import read_summary

REFLECTION_CURVE = ("reflection_rate", "reflection words per 1k tokens", "reflection.png")


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


def _evaluated_run(summary: dict, roots: dict[Path, int]) -> int | None:
    """Index of the run whose ``final/`` (or folder) the summary's model is, if it is one of ``roots``."""
    model = summary.get("model")
    if not isinstance(model, str) or not Path(model).exists():
        return None
    path = Path(model).resolve()
    for candidate in (path.parent, path) if path.name == "final" else (path,):
        if candidate in roots:
            return roots[candidate]
    return None


def compare(paths: list[Path], out: Path, baseline: str | None = None, notes: list[str] = (),
            warn=None) -> list[dict]:
    """Write the comparison of ``paths`` in ``out``; returns the table's rows (arms, then standalone evals).
    ``baseline``: the arm the seed tests compare against (an arm's label, its folder or an algorithm; default
    dapo's arm, else grpo's, else the first, said in the notes); a ``baseline`` that names no arm is a ValueError
    before anything is written. ``notes``: lines added to the table's notes (``stare run``'s failed steps). Each of
    the comparison's ``warnings`` (runs that differ in more than algorithm and seed) goes to ``warn`` too."""
    run_dirs, eval_dirs = collect(paths)
    runs, roots = [], {}
    for d in dict.fromkeys(run_dirs):  # a folder named twice is one run
        if _is_run(d):
            run = load_run(d)
        else:  # TensorBoard event files (OpenRLHF)
            root = run_root(d)
            tb = load_tb_run(d)  # its checkpoint sweeps live beside its config.yaml, as its evals do
            run = replace(tb, evals=read_evals(root), curves={**tb.curves, **read_checkpoint_curves(root)})
            roots.setdefault(root.resolve(), len(runs))
        roots.setdefault(Path(d).resolve(), len(runs))
        runs.append(run)
    standalone = []
    for e in eval_dirs:
        summary = read_summary(e)
        owner = _evaluated_run(summary, roots)
        if owner is None:
            standalone.append(summary)
        else:  # an evaluation of a run's final model joins that run's row
            runs[owner] = replace(runs[owner], evals={**runs[owner].evals, summary["bench"]: summary})
    summary = write_comparison(out, runs, evals=standalone, baseline=baseline, require_baseline=baseline is not None,
                               notes=notes)
    for line in summary["warnings"] if warn is not None else ():
        warn(line)
    if runs:
        plot_curves(out, runs, CURVES + (REFLECTION_CURVE,))
        plot_accuracy(out, runs)  # accuracy.png, when a run has an accuracy-over-training curve
        plot_dose_response(out, summary["dose_response"], summary["arms"])  # dose_response.png, for the arms of a --sweep
    return summary["arms"] + summary["evals"]
