"""An evaluation folder's record: the settings its samples were drawn with (``eval_settings.json``), what
``--resume`` checks against them, and the samples it keeps.

``eval_record`` is written (``write_record``) just before the first problem's samples, so a start that fails
before any problem is done leaves no record and no samples. ``holds_samples`` says whether a folder holds an
evaluation to continue (a finished one, or at least one whole sample line); one that does not (nothing there, or
what an older failed start left: a record and an empty ``samples.jsonl``) is a fresh start, for a run without
``--resume`` as for one with it. ``check_resume`` refuses a ``--resume`` with other settings (one line naming the
first flag that differs) or a corrupt ``samples.jsonl``; ``read_done`` keeps every problem whose k samples are all
on disk, drops a partly written one and a last line cut by a kill. ``EvalRefused`` is every refusal of ``stare
eval`` (the CLI prints one line and exits with code 2). Standard library only.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .jsonl import read_cut_jsonl
from .batching import BATCHING, DEFAULT_BATCHING, LEGACY_BATCHING
from .protocols import Protocol

class EvalRefused(ValueError):
    """An evaluation that cannot start or continue as asked (the CLI prints one line and exits with code 2):
    ``--resume`` with other settings than the folder's, a corrupt samples file, a model whose context fits no
    problem. Raised before anything is written."""


RECORD = "eval_settings.json"  # the settings an output folder's samples were drawn with, written just before the
# first problem's samples; --resume must ask for the same (summary.json holds them too, for folders from before it)
RECORD_KEYS = ("protocol", "k", "temperature", "top_p", "max_tokens", "seed", "model", "bench", "data", "tools",
               "batching")


def eval_record(proto: Protocol, *, seed: int, model: str, bench: str, data: str | None = None,
                tools: str | None = None, batching: str = DEFAULT_BATCHING) -> dict:
    """What the samples of an output folder depend on (``RECORD_KEYS``); a local model folder as its full path.
    ``batching`` (``stare.eval.batching``) goes in with the promise it makes (``batching_contract``, for a reader;
    not compared on ``--resume``)."""
    model_id = str(Path(model).resolve()) if Path(model).exists() else model
    return {"protocol": proto.name, "k": proto.k, "temperature": proto.temperature, "top_p": proto.top_p,
            "max_tokens": proto.max_tokens, "seed": seed, "model": model_id, "bench": bench, "data": data,
            "tools": tools, "batching": batching, "batching_contract": BATCHING[batching]}


_FLAGS = {"protocol": "--protocol", "k": "--k", "temperature": "--temperature", "top_p": "--top-p",
          "max_tokens": "--max-tokens", "seed": "--seed", "model": "--model", "bench": "--bench",
          "data": "--data-file", "tools": "--tools", "batching": "--batching"}


def _old_record(out: Path) -> dict | None:
    """The folder's record: eval_settings.json, else what its summary.json says (older folders), else None."""
    path = out / RECORD
    if path.is_file():
        try:
            rec = json.loads(path.read_text())
        except ValueError as exc:
            raise EvalRefused(f"{path} is corrupt ({exc}); use another --out (nothing was changed)") from None
        return rec if isinstance(rec, dict) else {}
    summary = out / "summary.json"
    if summary.is_file():
        try:
            s = json.loads(summary.read_text())
            proto = s.get("protocol") or {}
            return {"protocol": proto.get("name"), "k": s.get("k"), "temperature": proto.get("temperature"),
                    "top_p": proto.get("top_p"), "max_tokens": proto.get("max_tokens"), "seed": s.get("seed"),
                    "bench": s.get("bench")}
        except (ValueError, AttributeError):
            return None
    return None


def write_record(out: Path, record: dict) -> None:
    """``out/eval_settings.json`` (atomically)."""
    tmp = out / (RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out / RECORD)


def holds_samples(out: Path) -> bool:
    """``out`` holds an evaluation to keep or continue: its ``summary.json``, or a ``samples.jsonl`` whose first
    line is whole (a line cut by a kill is not a sample). A folder with a record but no sample (a start that failed
    before its first problem was done) holds none. Reads one line at most."""
    if (out / "summary.json").is_file():
        return True
    try:
        with open(out / "samples.jsonl", "rb") as f:
            return f.readline().endswith(b"\n")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return False


def recorded_batching(out: Path) -> str | None:
    """The ``--batching`` the samples in ``out`` were drawn with: its record's, ``problem`` for samples written
    before the mode was recorded, None for a folder without samples (``holds_samples``) or a record naming one."""
    if not holds_samples(out):
        return None
    try:
        old = _old_record(out)
    except EvalRefused:
        return None
    if old is not None and old.get("batching"):
        return old["batching"]
    if (out / "samples.jsonl").is_file() or (out / "summary.json").is_file():
        return LEGACY_BATCHING
    return None


def read_samples(samples_path: Path) -> tuple[list[dict], bool]:
    """The records of ``samples.jsonl`` and whether its last line was cut by a kill (then dropped). A corrupt
    line before the last is ``EvalRefused`` naming the file and line."""
    return read_cut_jsonl(samples_path, error=EvalRefused, not_a_record="not a sample record",
                          is_record=lambda r: isinstance(r, dict) and "problem_id" in r and "sample_idx" in r)


def check_resume(out: Path, record: dict) -> None:
    """``--resume`` in ``out`` continues the same evaluation: every setting in the folder's record equals the
    request's (one line naming the first that differs), and ``samples.jsonl`` has no corrupt line but a cut last
    one. A folder that holds no sample (``holds_samples``) has nothing to continue: any settings start it afresh.
    Raises ``EvalRefused``; reads only."""
    if not holds_samples(out):
        return
    old = _old_record(out)
    samples = out / "samples.jsonl"
    records = read_samples(samples)[0] if samples.is_file() else []
    if old is None and records:  # no record at all: the samples still say k
        old = {"k": max(int(r["sample_idx"]) for r in records) + 1}
    if old is not None and (old.get("batching") is None) and (records or (out / "summary.json").is_file()):
        old["batching"] = LEGACY_BATCHING  # samples drawn before --batching existed: one problem at a time
    for key in RECORD_KEYS:
        if old is None or key not in old or old[key] is None and key not in ("data", "tools"):
            continue
        if old[key] != record[key]:
            raise EvalRefused(f"{_FLAGS[key]} {_show(record[key])}: {out} holds samples drawn with {key} "
                              f"{_show(old[key])}; resume with the same settings or use another --out "
                              "(nothing was changed)")


def _show(value) -> str:
    return "(none)" if value is None else str(value)


def read_done(samples_path: Path, k: int, warn) -> dict[str, list[dict]]:
    """Problems whose k samples are all in ``samples.jsonl``; rewrites the file without partial problems. A last
    line cut by a kill is dropped (one warning, ``warn(message)``); a corrupt line elsewhere is ``EvalRefused``."""
    if not samples_path.exists():
        return {}
    rows: dict[str, list[dict]] = {}
    records, cut = read_samples(samples_path)
    if cut:
        warn(f"{samples_path}: the last line was cut (a kill during its write); dropped, its problem is sampled "
             "again")
    for rec in records:
        rows.setdefault(str(rec["problem_id"]), []).append(rec)
    done = {pid: sorted(r, key=lambda x: x["sample_idx"]) for pid, r in rows.items()
            if sorted(x["sample_idx"] for x in r) == list(range(k))}
    tmp = samples_path.with_name(samples_path.name + ".tmp")
    tmp.write_text("".join(json.dumps(rec) + "\n" for recs in done.values() for rec in recs))
    os.replace(tmp, samples_path)
    return done
