"""The one summary builder of both eval harnesses (``stare eval`` and ``stare eval --harness lm-eval``).

Both write ``summary.json`` with the same core fields (``core_summary``: bench, model, backend, seed, k, n_problems,
the per-problem metrics of ``stare.eval.metrics.METRICS`` (avg_at_k, pass_at_k, maj_at_k), ci95 (their 95%
bootstrap intervals over problems), protocol, per_problem), plus their own (the over-samples metrics: response
length, reflection rate; versions, tools, lm-eval's task), written atomically; and a ``summary.md`` from
``summary_markdown``: a setup line, the metric table and the per-problem accuracies. ``summarise`` is
``stare eval``'s: the core fields, the response statistics and the outcome of its samples (truncated, not
attempted), and the tool use under ``--tools``. The local engine's ``eval.json`` uses the same names for what it shares (k, n_problems, avg_at_k, pass_at_k).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from .backends import versions
from .metrics import METRICS, PER_PROBLEM_ROW, bootstrap_ci, problem_means, problem_metrics, problem_values, \
    sample_values
from .protocols import Protocol


def core_summary(*, bench: str, model: str, backend: str, seed: int, proto, values: dict[str, list[float]],
                 ids: list, answers: list, scores: dict | None = None) -> dict:
    """The fields every summary.json has. ``values``: each per-problem metric's values (``problem_metrics()`` keys,
    one value per problem); each metric is their mean unless ``scores`` gives it (lm-eval's own aggregates), and
    ``ci95`` holds the bootstrap intervals of those with an interval."""
    means = problem_means({m.key: values[m.key] for m in problem_metrics()})
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


def attempted(ordered: list[list[dict]]) -> list[dict]:
    """The samples of the problems that were attempted (their prompt fit the model's context)."""
    return [r for recs in ordered for r in recs if not r.get("not_attempted")]


def outcome_fields(problems, ordered: list[list[dict]]) -> dict:
    """summary.json's ``truncated`` (share of attempted samples cut by the token limit or the model's context),
    ``not_attempted`` (problems whose prompt did not fit the context; their samples score 0) and
    ``not_attempted_ids``. Samples written before these fields existed count as not truncated, attempted."""
    tried = attempted(ordered)
    skipped = [p.id for p, recs in zip(problems, ordered) if any(r.get("not_attempted") for r in recs)]
    return {"truncated": sum(bool(r.get("truncated")) for r in tried) / len(tried) if tried else 0.0,
            "not_attempted": len(skipped), "not_attempted_ids": skipped}


def outcome_md(summary: dict) -> list[tuple[str, str]]:
    """summary.md's (name, value) rows for ``outcome_fields``."""
    rows = [("truncated (share of attempted samples)", f"{summary['truncated']:.4f}")]
    if summary["not_attempted"]:
        rows.append(("problems not attempted (prompt longer than the context; scored 0)",
                     f"{summary['not_attempted']} ({', '.join(map(str, summary['not_attempted_ids']))})"))
    return rows


def summarise(problems, results, proto: Protocol, *, bench, model, backend, seed, out: Path, tools=None,
              engines: int = 1, batching: str | None = None) -> dict:
    ordered = [results[p.id] for p in problems]
    correct = [[r["correct"] for r in recs] for recs in ordered]
    extracted = [[r["extracted"] for r in recs] for recs in ordered]
    k = proto.k
    tried = attempted(ordered)  # response statistics: of the samples that were generated
    summary = core_summary(bench=bench, model=model, backend=backend, seed=seed, proto=proto,
                           values=problem_values(correct, extracted, k), ids=[p.id for p in problems],
                           answers=[p.answer for p in problems])
    summary.update({
        **sample_values([r["response"] for r in tried], [r["num_tokens"] for r in tried]),
        **outcome_fields(problems, ordered),
        "versions": versions(),
        "engines": engines,  # how many engines drew the samples (the last run's, after --resume); not the numbers
        "batching": batching,  # --batching (stare.eval.batching): what the samples promise across resume and engines
    })
    extra_rows = outcome_md(summary)
    if tools is not None:  # --tools: the tool settings, the mean turns / tool calls per sample, the sandbox
        flat = [r for recs in ordered for r in recs]
        summary["tools"] = tools
        summary["mean_turns"] = sum(r.get("turns", 0) for r in flat) / len(flat)
        summary["mean_tool_calls"] = sum(r.get("tool_calls", 0) for r in flat) / len(flat)
        # the isolation the samples' tool calls ran with (several, "/"-joined, when a resumed run changed machines;
        # samples written before it was recorded are left out)
        used = sorted({r["sandbox_isolation"] for r in flat if r.get("sandbox_isolation")})
        summary["sandbox_isolation"] = "/".join(used) or None
        extra_rows += [("mean turns", f"{summary['mean_turns']:.2f}"),
                       ("mean tool calls", f"{summary['mean_tool_calls']:.2f}"),
                       ("sandbox isolation", summary["sandbox_isolation"] or "(not recorded)")]
    write_summary(out, summary, title=f"{bench}: {model}",
                  setup=f"protocol {proto.name}: k {k}, temperature {proto.temperature}, top_p {proto.top_p}, "
                        f"max tokens {proto.max_tokens}; backend {backend}"
                        + (f" x {engines} engines" if engines > 1 else "")
                        + (f", batching {batching}" if batching else "") + f"; seed {seed}; {len(problems)} problems",
                  extra_rows=extra_rows)
    return summary


def read_summary(folder: Path) -> dict:
    """``folder/summary.json`` (a ``stare eval`` output); ValueError naming the file when it is not readable."""
    path = Path(folder) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("bench"), str):
        raise ValueError(f"{path} is malformed: expected a JSON object with a bench name")
    return summary
