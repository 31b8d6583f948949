"""The training prompt file OpenRLHF reads: one JSON line per problem, ``{"prompt": ..., "label": ...}``.

OpenRLHF applies the chat template to ``prompt`` as the user message, so the preset's ``prompt_template``
(the boxed-answer instruction) must already be in it; its ``label_key`` cannot reach nested fields. So
``stare train`` normalises the source once, before launch, into ``RUN/data/train.jsonl``:

- rows with ``problem`` + ``answer`` (this project's format, also ``stare eval --data-file``);
- DAPO-Math-17k as published (``prompt`` = a chat list whose user message wraps the problem in DAPO's own
  "Answer:" instruction, ``reward_model.ground_truth``): the wrapper is removed so our template applies, and
  the set's repeated rows are dropped (it holds each problem many times);
- rows with a plain-string ``prompt`` + ``solution`` (processed DAPO copies).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from stare.eval.data import answer_str, read_rows

_DAPO_HEAD = re.compile(r"^\s*Solve the following math problem step by step\..*?\n\n", re.S)
_DAPO_TAIL = re.compile(r"\n\nRemember to put your answer on its own line after \"Answer:\"\.?\s*$", re.S)


def strip_dapo_instruction(text: str) -> str:
    """The bare problem from DAPO-Math-17k's instruction-wrapped user message (other text unchanged)."""
    if not _DAPO_HEAD.match(text):
        return text.strip()
    return _DAPO_TAIL.sub("", _DAPO_HEAD.sub("", text, count=1)).strip()


def normalise_row(row: dict, where: str) -> tuple[str, str]:
    """(problem, answer) from one source row; ``ValueError`` naming the row when neither layout fits."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    problem, answer = row.get("problem"), row.get("answer")
    if problem is None:
        prompt = row.get("prompt")
        if isinstance(prompt, list):  # a chat: the (last) user message
            users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
            prompt = users[-1] if users else None
        problem = strip_dapo_instruction(prompt) if isinstance(prompt, str) else None
    if answer is None:
        rm = row.get("reward_model")
        answer = rm.get("ground_truth") if isinstance(rm, dict) else row.get("solution")
    if not isinstance(problem, str) or not problem.strip() or answer is None or not answer_str(answer):
        raise ValueError(f"{where}: needs problem + answer, a DAPO-style prompt + reward_model.ground_truth, "
                         f"or prompt + solution (has {sorted(row)})")
    return problem.strip(), answer_str(answer)


def _read_rows(source: str, split: str):
    path = Path(source)
    if path.suffix.lower() in (".jsonl", ".json", ".parquet") or path.exists():
        return read_rows(path, "training data file")[0], str(path)
    if source.count("/") != 1:
        raise ValueError(f"training data {source!r} is neither a file nor a hub id (owner/name)")
    import datasets

    # the dataset itself (iterable, sized): DAPO-Math-17k as published has about 1.8M rows, not worth a list
    return datasets.load_dataset(source, split=split), f"{source}[{split}]"


def prepare_prompts(source: str, template: str, out_file: Path, *, split: str = "train") -> dict:
    """Write the OpenRLHF prompt file; returns ``{"rows", "problems", "source"}``. Idempotent per source."""
    out_file = Path(out_file)
    stamp = out_file.with_suffix(".source.json")
    want = {"source": source, "split": split, "template": template}
    if out_file.exists() and stamp.exists():
        done = json.loads(stamp.read_text())
        if {k: done.get(k) for k in want} == want:
            return done
    rows, where = _read_rows(source, split)
    seen: set[str] = set()
    lines = []
    for i, row in enumerate(rows):
        problem, answer = normalise_row(row, f"{where} row {i}")
        if problem in seen:
            continue
        seen.add(problem)
        lines.append(json.dumps({"prompt": template.replace("{problem}", problem), "label": answer},
                                ensure_ascii=False))
    if not lines:
        raise ValueError(f"{where}: no problems")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, out_file)
    info = {**want, "rows": len(rows), "problems": len(lines)}
    stamp.write_text(json.dumps(info, indent=1))
    return info


def prepare_eval_prompts(bench: str, template: str, out_file: Path) -> dict:
    """Write the in-training evaluation's prompt file: ``bench``'s problems (``stare.eval.load_bench``: the shipped
    copy or ``$STARE_DATA_DIR``'s) as ``{"prompt", "label", "datasource": bench}`` lines, the prompt in the training
    ``template`` (OpenRLHF applies the same chat template and the same ``input_key``/``label_key`` to both sets, and
    names its eval scalars after ``datasource``). Returns ``{"bench", "problems"}``."""
    from stare.eval import load_bench

    problems = load_bench(bench)
    lines = [json.dumps({"prompt": template.replace("{problem}", p.problem), "label": p.answer, "datasource": bench},
                        ensure_ascii=False) for p in problems]
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, out_file)
    return {"bench": bench, "problems": len(lines)}
