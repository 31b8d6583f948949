"""The one summary builder of both eval harnesses (``stare eval`` and ``stare eval --harness lm-eval``).

Both write ``summary.json`` with the same core fields (``core_summary``: bench, model, backend, seed, k, n_problems,
the per-problem metrics of ``stare.eval.metrics.METRICS`` (avg_at_k, pass_at_k, maj_at_k), ci95 (their 95%
bootstrap intervals over problems), protocol, per_problem), plus their own (the over-samples metrics: response
length, reflection rate; versions, tools, lm-eval's task), written atomically; and a ``summary.md`` from
``summary_markdown``: a setup line, the metric table and the per-problem accuracies. The local
engine's ``eval.json`` uses the same names for what it shares (k, n_problems, avg_at_k, pass_at_k).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from .metrics import METRICS, PER_PROBLEM_ROW, bootstrap_ci, problem_metrics


def core_summary(*, bench: str, model: str, backend: str, seed: int, proto, values: dict[str, list[float]],
                 ids: list, answers: list, scores: dict | None = None) -> dict:
    """The fields every summary.json has. ``values``: each per-problem metric's values (``problem_metrics()`` keys,
    one value per problem); each metric is their mean unless ``scores`` gives it (lm-eval's own aggregates), and
    ``ci95`` holds the bootstrap intervals of those with an interval."""
    means = {m.key: sum(values[m.key]) / len(values[m.key]) for m in problem_metrics()}
    means.update(scores or {})
    per_problem = values[PER_PROBLEM_ROW]
    return {
        "bench": bench, "model": model, "backend": backend, "seed": seed, "k": proto.k, "n_problems": len(per_problem),
        **means,
        "ci95": {m.key: list(bootstrap_ci(values[m.key])) for m in problem_metrics() if m.interval},
        "protocol": asdict(proto),
        "per_problem": [{"id": i, "accuracy": acc, "answer": a} for i, acc, a in zip(ids, per_problem, answers)],
    }


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and a rename (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def summary_markdown(summary: dict, *, title: str, setup: str, extra_rows: list[tuple[str, str]] = ()) -> str:
    """summary.md: ``title``, the ``setup`` line, the metrics of ``METRICS`` (with their intervals; one not measured
    has no row), ``extra_rows`` ((name, value) pairs), then the per-problem accuracies."""
    k, ci = summary["k"], summary["ci95"]
    md = [f"# {title}", "", setup, "", "| metric | value | 95% bootstrap interval |", "|---|---|---|"]
    for m in METRICS:
        value, d = summary.get(m.key), m.digits
        if m.interval:
            md.append(f"| {m.label(k)} | {value:.{d}f} | [{ci[m.key][0]:.{d}f}, {ci[m.key][1]:.{d}f}] |")
        elif value is not None:  # not measured: no row
            md.append(f"| {m.label(k)} | {value:.{d}f} | |")
    md += [f"| {name} | {value} | |" for name, value in extra_rows]
    md += ["", "| problem | answer | accuracy |", "|---|---|---|"]
    md += [f"| {row['id']} | {row['answer']} | {row['accuracy']:.3f} |" for row in summary["per_problem"]]
    return "\n".join(md) + "\n"


def scores_line(summary: dict) -> str:
    """The ``printed`` metrics of a summary on one line, as ``stare eval`` prints them: ``avg@32 0.4000  ...``."""
    return "  ".join(f"{m.label(summary['k'])} {summary[m.key]:.{m.digits}f}" for m in METRICS if m.printed)


def write_summary(out: Path, summary: dict, *, title: str, setup: str, extra_rows: list[tuple[str, str]] = ()) -> None:
    """``out/summary.json`` (atomically) and ``out/summary.md``."""
    write_json_atomic(Path(out) / "summary.json", summary)
    (Path(out) / "summary.md").write_text(summary_markdown(summary, title=title, setup=setup, extra_rows=extra_rows))
