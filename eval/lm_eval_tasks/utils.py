"""Hooks the stare_aime24 / stare_aime25 lm-eval tasks name with ``!function utils.NAME``.

- ``process_docs``: every source (the hub copies, a local JSONL/parquet file) becomes rows of ``id``,
  ``problem`` and ``answer`` strings, with the same escape repair and answer formatting as ``stare.eval.load_bench``.
- ``doc_to_text``: the problem and the boxed-answer instruction, exactly as ``stare eval`` asks it.
- ``keep_all``: a filter that keeps all ``repeats`` responses of a problem (lm-eval's default keeps the first).
- ``process_results``: scores every response's last ``\\boxed{}`` answer with ``stare.eval.score_many``
  (math-verify, so "033" equals 33 and \\frac12 equals 0.5) and returns each per-problem metric of
  ``stare.eval.metrics.METRICS`` over its k samples, as the stare harness computes it: the accuracy (``avg_at_k``;
  its mean over problems is avg@k), pass@k with k = n (whether any sample is right, ``pass_at_k``) and whether the
  majority answer is right (``maj_at_k``). lm-eval aggregates what the task's ``metric_list`` names, so a new
  per-problem metric is listed there too (``_stare_aime_base.yaml``; a test checks the two agree).
"""
from __future__ import annotations

from stare.eval.data import answer_str, repair_escapes
from stare.eval.protocols import BOXED_INSTRUCTION
from stare.eval.metrics import problem_metrics
from stare.eval.extraction import extract_boxed
from stare.eval.scoring import score_many

def _field(row: dict, name: str):
    """``row[name]``, matching the field name case-insensitively (Maxwell-Jia/AIME_2024 has Problem, Answer, ID)."""
    if name in row:
        return row[name]
    return next((v for k, v in row.items() if k.lower() == name), None)


def process_docs(dataset):
    """Rows of any source -> ``{"id", "problem", "answer"}`` strings; the row index is the id when there is none."""
    def normalise(row: dict, index: int) -> dict:
        rid = _field(row, "id")
        problem, answer = _field(row, "problem"), _field(row, "answer")
        if problem is None or answer is None:
            raise ValueError(f"row {index} has no problem or answer field (fields: {sorted(row)})")
        return {"id": str(index) if rid is None or str(rid).strip() == "" else str(rid).strip(),
                "problem": repair_escapes(str(problem)), "answer": answer_str(answer)}

    from datasets import Features, Value

    # explicit string features: a JSON file mixing "2" and 5 loads as a Json column, which would decode "2" to 2
    return dataset.map(normalise, with_indices=True, remove_columns=dataset.column_names,
                       features=Features({name: Value("string") for name in ("id", "problem", "answer")}))


def doc_to_text(doc: dict) -> str:
    return f"{doc['problem']}\n{BOXED_INSTRUCTION}"


def keep_all(resps, docs):
    """Filter: every response of every problem, unchanged (one list of ``repeats`` strings per problem)."""
    return resps


def _responses(results) -> list[str]:
    # with keep_all, lm-eval passes [[r_1, ..., r_k]]; with a take-first style filter, [r_1]
    if len(results) == 1 and isinstance(results[0], (list, tuple)):
        return [str(r) for r in results[0]]
    return [str(r) for r in results]


def process_results(doc: dict, results) -> dict[str, float]:
    """Every per-problem metric of ``stare.eval.metrics.METRICS`` for this problem's responses (k = their count),
    computed as the stare harness computes it."""
    responses = _responses(results)
    if not responses:
        return {m.key: 0.0 for m in problem_metrics()}
    correct = score_many([(r, doc["answer"]) for r in responses])
    extracted = [extract_boxed(r) for r in responses]
    return {m.key: m.per_problem(correct, extracted, len(correct)) for m in problem_metrics()}
