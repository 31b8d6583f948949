"""The one summary builder of both eval harnesses (``stare eval`` and ``stare eval --harness lm-eval``).

Both write ``summary.json`` with the same core fields (``core_summary``: bench, model, backend, seed, k, n_problems,
avg_at_k, pass_at_k, maj_at_k, ci95 (95% bootstrap intervals over problems of the three), protocol, per_problem),
plus their own (response length, reflection rate, versions, tools, lm-eval's task), written atomically; and a
``summary.md`` from ``summary_markdown``: a setup line, the metric table and the per-problem accuracies. The local
engine's ``eval.json`` uses the same names for what it shares (k, n_problems, avg_at_k, pass_at_k).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from .metrics import bootstrap_ci

SCORES = (("avg", "avg_at_k"), ("pass", "pass_at_k"), ("maj", "maj_at_k"))


def core_summary(*, bench: str, model: str, backend: str, seed: int, proto, per_problem: list[float],
                 per_pass: list[float], per_maj: list[float], ids: list, answers: list,
                 scores: dict | None = None) -> dict:
    """The fields every summary.json has. ``per_problem``, ``per_pass``, ``per_maj``: one value per problem (its
    accuracy over the k samples, its unbiased pass@k, its majority-vote correctness); avg@k, pass@k and maj@k are
    their means unless ``scores`` gives them (lm-eval's own aggregates), and ci95 their bootstrap intervals."""
    means = {key: sum(v) / len(v) for key, v in (("avg_at_k", per_problem), ("pass_at_k", per_pass),
                                                  ("maj_at_k", per_maj))}
    means.update(scores or {})
    return {
        "bench": bench, "model": model, "backend": backend, "seed": seed, "k": proto.k, "n_problems": len(per_problem),
        **means,
        "ci95": {"avg_at_k": list(bootstrap_ci(per_problem)), "pass_at_k": list(bootstrap_ci(per_pass)),
                 "maj_at_k": list(bootstrap_ci(per_maj))},
        "protocol": asdict(proto),
        "per_problem": [{"id": i, "accuracy": acc, "answer": a} for i, acc, a in zip(ids, per_problem, answers)],
    }


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and a rename (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def summary_markdown(summary: dict, *, title: str, setup: str, extra_rows: list[tuple[str, str]] = ()) -> str:
    """summary.md: ``title``, the ``setup`` line, avg/pass/maj@k with their intervals, mean response tokens and
    reflection rate (when measured), ``extra_rows`` ((name, value) pairs), then the per-problem accuracies."""
    k, ci = summary["k"], summary["ci95"]
    md = [f"# {title}", "", setup, "", "| metric | value | 95% bootstrap interval |", "|---|---|---|"]
    md += [f"| {label}@{k} | {summary[key]:.4f} | [{ci[key][0]:.4f}, {ci[key][1]:.4f}] |" for label, key in SCORES]
    if summary.get("mean_response_tokens") is not None:
        md.append(f"| mean response tokens | {summary['mean_response_tokens']:.1f} | |")
    if summary.get("reflection_per_1k_tokens") is not None:
        md.append(f"| reflection words per 1k tokens | {summary['reflection_per_1k_tokens']:.2f} | |")
    md += [f"| {name} | {value} | |" for name, value in extra_rows]
    md += ["", "| problem | answer | accuracy |", "|---|---|---|"]
    md += [f"| {row['id']} | {row['answer']} | {row['accuracy']:.3f} |" for row in summary["per_problem"]]
    return "\n".join(md) + "\n"


def write_summary(out: Path, summary: dict, *, title: str, setup: str, extra_rows: list[tuple[str, str]] = ()) -> None:
    """``out/summary.json`` (atomically) and ``out/summary.md``."""
    write_json_atomic(Path(out) / "summary.json", summary)
    (Path(out) / "summary.md").write_text(summary_markdown(summary, title=title, setup=setup, extra_rows=extra_rows))
