"""JSONL files that a kill may have cut: ``samples.jsonl`` of an evaluation and ``metrics.jsonl`` of a training run;
and ``read_utf8``, the reader of a user's text files (problem files, preset files) that names the line of a bad byte.

A process killed while writing leaves at most its last line cut; that line is dropped (and redone by the resume).
A line that does not parse anywhere else is damage a resume cannot repair, and is refused naming the file and line.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def read_cut_jsonl(path: Path, *, error: type[Exception], is_record: Callable[[object], bool],
                   not_a_record: str, what: str = "line", skip_blank: bool = False) -> tuple[list[dict], bool]:
    """(records, whether the last line was cut and dropped). A line that is not JSON, or whose value fails
    ``is_record`` (``not_a_record`` says why), raises ``error`` naming ``path`` and the line, unless it is the last
    one. Trailing blank lines are ignored; ``skip_blank`` ignores blank lines in between too."""
    lines = Path(path).read_text(errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    records, cut = [], False
    for i, line in enumerate(lines):
        if skip_blank and not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not is_record(rec):
                raise ValueError(not_a_record)
        except ValueError as exc:
            if i == len(lines) - 1:
                cut = True  # the last line, cut by a kill during its write: dropped, and redone
                break
            raise error(f"{path} line {i + 1} is corrupt ({str(exc).splitlines()[0]}), not the last {what} cut by a "
                        "kill; it cannot be resumed: use another --out (nothing was changed)") from None
        records.append(rec)
    return records, cut


def decode_utf8(data: bytes, source: str) -> str:
    """``data`` as UTF-8 text; a one-line ``ValueError`` naming ``source``, the line and column of the first byte
    that is not UTF-8, and the byte, otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ValueError(f"{source}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at column {column}); "
                         "save the file as UTF-8") from None


def read_utf8(path: Path) -> str:
    """The text of a user's file (``decode_utf8``)."""
    return decode_utf8(Path(path).read_bytes(), str(path))
