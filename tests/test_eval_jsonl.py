"""stare.eval.jsonl (eval/jsonl.py): ``read_cut_jsonl`` (a JSONL file a kill may have cut: only the last line may be
dropped) and ``decode_utf8`` / ``read_utf8`` (a bad byte named by line and column), on files written by hand."""
import json

import pytest

from stare.eval.jsonl import decode_utf8, read_cut_jsonl, read_utf8


class Refused(ValueError):
    pass


def read(path, **kw):
    kw.setdefault("is_record", lambda r: isinstance(r, dict) and "step" in r)
    return read_cut_jsonl(path, error=Refused, not_a_record="no step", **kw)


def test_whole_lines_are_read_and_trailing_blank_lines_ignored(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "x": [1, 2]}\n\n  \n')
    assert read(path) == ([{"step": 1}, {"step": 2, "x": [1, 2]}], False)


@pytest.mark.parametrize("last", ['{"step": 3', '{"ste', '{"other": 1}', "[1, 2]"])
def test_a_cut_or_foreign_last_line_is_dropped_and_said(tmp_path, last):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n' + last)
    assert read(path) == ([{"step": 1}, {"step": 2}], True)


def test_a_bad_line_before_the_last_is_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{not json\n{"step": 3}\n')
    with pytest.raises(Refused, match=rf"^{path} line 2 is corrupt \(.*\), not the last line cut by a kill"):
        read(path)
    path.write_text('{"step": 1}\n{"step": 2}\n{"other": 3}\n{"step": 4}\n')  # JSON, but not a record
    with pytest.raises(Refused, match=rf"^{path} line 3 is corrupt \(no step\), not the last sample cut"):
        read(path, what="sample")


def test_a_blank_line_in_between_is_refused_unless_skipped(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n')
    with pytest.raises(Refused, match="line 2 is corrupt"):
        read(path)
    assert read(path, skip_blank=True) == ([{"step": 1}, {"step": 2}], False)


def test_an_empty_file_has_no_records(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("\n")
    assert read(path) == ([], False)


def test_the_records_are_what_json_reads_line_by_line(tmp_path):
    rows = [{"step": i, "loss": i / 7, "s": "é\u00e9"} for i in range(20)]
    path = tmp_path / "m.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text[:-9])  # the last line cut
    assert read(path) == (rows[:-1], True)


@pytest.mark.parametrize("data, line, column, byte", [
    (b"\xffabc", 1, 1, "ff"),
    (b"ab\ncd\xe9f\n", 2, 3, "e9"),  # Latin-1 e-acute: the third byte of line 2
    (b"x\n\n\nok \xc3\xa9 \x80", 4, 7, "80"),  # o k space, e-acute (two bytes), space: the 7th byte
])
def test_decode_utf8_names_line_column_and_byte(data, line, column, byte):
    with pytest.raises(ValueError) as err:
        decode_utf8(data, "problems.jsonl")
    assert str(err.value) == (f"problems.jsonl:{line}: not UTF-8 text (byte 0x{byte} at column {column}); save the "
                              "file as UTF-8")


def test_read_utf8_reads_a_file_and_names_it(tmp_path):
    good = tmp_path / "good.txt"
    good.write_bytes("a\n\u00e9\n".encode())
    assert read_utf8(good) == "a\n\u00e9\n"
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a\nb\xfe")
    with pytest.raises(ValueError, match=rf"^{bad}:2: not UTF-8 text \(byte 0xfe at column 2\)"):
        read_utf8(bad)
