"""Benchmark problems (AIME 2024/2025, AMC 2023, MATH-500): packaged copies, local JSONL/parquet files or the hub.

``load_bench(name)`` looks, in order, at ``data_file=`` (a JSONL or parquet file with ``problem`` and ``answer``
fields, ``id`` optional; ``"hub"`` means the Hugging Face hub), at ``$STARE_DATA_DIR/<name>.jsonl`` (or
``.parquet``; ``STARE_DATA_DIR=hub`` also means the hub), at the copy shipped with the package
(``stare/eval/data_files/<name>.jsonl``: AIME 2024 and 2025, AMC 2023 and MATH-500, sources and licences in
``SOURCES.txt`` there), and
finally at the hub copies listed in ``BENCHES`` (first that loads wins). Every problem comes back as a ``Problem``
with string fields. Nothing but the hub reaches the network; with ``HF_HUB_OFFLINE=1`` it reads only the cache.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .jsonl import read_utf8

DATA_DIR_ENV = "STARE_DATA_DIR"
HUB = "hub"  # as data_file= / --data-file or as $STARE_DATA_DIR: read the Hugging Face hub
PACKAGED_DIR = Path(__file__).resolve().with_name("data_files")  # the shipped copies (package data)


@dataclass(frozen=True)
class Problem:
    id: str
    problem: str
    answer: str


@dataclass(frozen=True)
class HubSource:
    """One copy of a benchmark on the Hugging Face hub and where its fields live."""
    repo: str
    split: str
    problem_field: str
    answer_field: str
    id_field: str | None = None  # None (or absent in a row): the row index is the id
    config: str | None = None


@dataclass(frozen=True)
class BenchSpec:
    name: str
    sources: tuple[HubSource, ...]  # tried in order


BENCHES: dict[str, BenchSpec] = {
    "aime24": BenchSpec("aime24", (
        HubSource("HuggingFaceH4/aime_2024", "train", "problem", "answer", "id"),
        HubSource("Maxwell-Jia/AIME_2024", "train", "Problem", "Answer", "ID"),
    )),
    # math-ai/aime25 rows 18, 19 and 27 carry "\f"/"\t" read as control characters; repair_escapes() fixes them
    # (applied to every loaded problem).
    "aime25": BenchSpec("aime25", (
        HubSource("math-ai/aime25", "test", "problem", "answer", "id"),
        HubSource("MathArena/aime_2025", "train", "problem", "answer", "problem_idx"),
    )),
    "amc23": BenchSpec("amc23", (
        HubSource("math-ai/amc23", "test", "question", "answer", "id"),
    )),
    "math500": BenchSpec("math500", (
        HubSource("HuggingFaceH4/MATH-500", "test", "problem", "answer", "unique_id"),
    )),
}


# A LaTeX command whose backslash escape was read as a control character: "\f" + "rac" -> form feed + "rac".
# Only whole letter runs that complete a known command are repaired, so ordinary tabs and newlines survive.
_BROKEN_ESCAPES: dict[str, tuple[str, frozenset[str]]] = {
    "\x0c": ("f", frozenset({"rac", "orall", "latex"})),
    "\t": ("t", frozenset({"ext", "extbf", "extit", "extrm", "imes", "heta", "an", "riangle", "au", "frac",
                           "ilde", "o", "op", "extstyle"})),
    "\x08": ("b", frozenset({"inom", "eta", "oxed", "ar", "egin", "f", "ig", "igg", "mod", "ot", "ullet", "oldsymbol"})),
    "\x07": ("a", frozenset({"lpha", "pprox", "ngle", "st"})),
    "\x0b": ("v", frozenset({"ec", "arepsilon", "arphi", "ee", "dots"})),
    "\r": ("r", frozenset({"ight", "ho", "angle", "ceil", "floor", "m"})),
}
_BROKEN_RE = re.compile("([" + "".join(re.escape(c) for c in _BROKEN_ESCAPES) + "])([A-Za-z]+)")


def repair_escapes(text: str) -> str:
    """Undo LaTeX escapes that a JSON round trip turned into control characters ("\\x0crac" -> "\\frac")."""
    def fix(m: re.Match) -> str:
        letter, tails = _BROKEN_ESCAPES[m.group(1)]
        return "\\" + letter + m.group(2) if m.group(2) in tails else m.group(0)

    return _BROKEN_RE.sub(fix, text)


def _answer_str(value) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


answer_str = _answer_str  # public name: a dataset answer (int, float, text) as the string the checker compares


def _to_problems(rows, where: str, *, problem_field: str = "problem", answer_field: str = "answer",
                 id_field: str | None = "id", line_numbers: list[int] | None = None) -> list[Problem]:
    """Rows (dicts) -> Problems; ``where`` names the file or repo in error messages."""
    out: list[Problem] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        loc = f"{where} row {i}" + (f" (line {line_numbers[i]})" if line_numbers else "")
        if not isinstance(row, dict):
            raise ValueError(f"{loc}: expected a JSON object, got {type(row).__name__}")
        for field in (problem_field, answer_field):
            v = row.get(field)
            if v is None or (isinstance(v, str) and not v.strip()):
                raise ValueError(f"{loc}: missing or empty {field!r} field (has {sorted(row)})")
        rid = row.get(id_field) if id_field else None
        pid = str(i) if rid is None or (isinstance(rid, str) and not rid.strip()) else str(rid).strip()
        if pid in seen:
            raise ValueError(f"{loc}: duplicate id {pid!r}")
        seen.add(pid)
        out.append(Problem(id=pid, problem=repair_escapes(str(row[problem_field])),
                           answer=_answer_str(row[answer_field])))
    if not out:
        raise ValueError(f"{where}: no problems (empty file or dataset)")
    return out


def read_rows(path: Path, what: str = "data file") -> tuple[list, list[int] | None]:
    """The rows of a user's problem file (``.jsonl``: one JSON value a non-blank line; ``.json``: a list, or one
    object; ``.parquet``) and, for ``.jsonl``, their line numbers: the one reader of problem files, for ``stare eval``
    and the OpenRLHF prompt file alike. A bad line, byte or file is a one-line ``ValueError`` naming ``path`` (and the
    line); ``what`` names the file's role in the message for a missing file or a folder."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder; expected a .jsonl, .json or .parquet file")
    if not path.is_file():
        raise ValueError(f"{what} not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows, lines = [], []
        for lineno, line in enumerate(read_utf8(path).split("\n"), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON line ({e.msg})") from None
            lines.append(lineno)
        return rows, lines
    if suffix == ".json":
        try:
            data = json.loads(read_utf8(path))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: malformed JSON ({e.msg})") from None
        return (data if isinstance(data, list) else [data]), None
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist(), None
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for unreadable files
            raise ValueError(f"{path}: cannot read parquet file ({type(e).__name__}: {e})") from None
    raise ValueError(f"{path}: unsupported {what} type {suffix or '(none)'!r}; use .jsonl, .json or .parquet")


def _read_local(path: Path) -> list[Problem]:
    if Path(path).is_dir():
        raise ValueError(f"--data-file {path} is a folder; expected a .jsonl, .json or .parquet file with problem and "
                         "answer fields (or 'hub')")
    rows, lines = read_rows(path)
    return _to_problems(rows, str(path), line_numbers=lines)


def _load_hub(spec: BenchSpec) -> list[Problem]:
    import datasets

    errors = []
    for src in spec.sources:
        try:
            ds = datasets.load_dataset(src.repo, src.config, split=src.split)
        except Exception as e:  # noqa: BLE001 - network, auth and missing-repo errors all mean "try the next copy"
            errors.append(f"{src.repo}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        return _to_problems(list(ds), f"{src.repo}[{src.split}]", problem_field=src.problem_field,
                            answer_field=src.answer_field, id_field=src.id_field)
    raise ValueError(f"could not load {spec.name!r} from the Hugging Face hub ({'; '.join(errors)}); "
                     f"pass --data-file FILE (data_file= in Python) or set {DATA_DIR_ENV} to a folder with "
                     f"{spec.name}.jsonl")


def load_bench(name: str, *, data_file: str | os.PathLike | None = None, limit: int | None = None) -> list[Problem]:
    """The problems of benchmark ``name`` (one of ``BENCHES``), the first ``limit`` of them when given."""
    if name not in BENCHES:
        raise ValueError(f"unknown benchmark {name!r}; choose one of {', '.join(sorted(BENCHES))}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    local = local_data_file(name, data_file)
    problems = _read_local(local) if local is not None else _load_hub(BENCHES[name])
    return problems[:limit] if limit is not None else problems


def _is_hub(value) -> bool:
    return isinstance(value, (str, os.PathLike)) and os.fspath(value) == HUB


def packaged_data_file(name: str) -> Path | None:
    """The copy of ``name`` shipped with the package, or None when there is none (every bench in ``BENCHES`` has
    one today; a bench added later may not)."""
    path = PACKAGED_DIR / f"{name}.jsonl"
    return path if path.is_file() else None


def local_data_file(name: str, data_file: str | os.PathLike | None = None) -> Path | None:
    """The local file ``load_bench`` reads for ``name`` (``data_file``, else ``$STARE_DATA_DIR/<name>.jsonl`` or
    ``.parquet``, else the packaged copy), or None when the problems come from the hub (``data_file="hub"``,
    ``STARE_DATA_DIR=hub``, or no local copy at all)."""
    if data_file is not None:
        return None if _is_hub(data_file) else Path(data_file)
    folder = os.environ.get(DATA_DIR_ENV)
    if folder:
        if folder == HUB:
            return None
        candidates = [Path(folder) / f"{name}.jsonl", Path(folder) / f"{name}.parquet"]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise ValueError(f"{DATA_DIR_ENV}={folder} has no {name}.jsonl or {name}.parquet")
        return found
    return packaged_data_file(name)
