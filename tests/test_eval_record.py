"""stare.eval.record (eval/record.py): an evaluation folder's record (``eval_record``, ``write_record``), whether it
holds samples (``holds_samples``), its batching (``recorded_batching``), the ``--resume`` check (``check_resume``) and
the problems kept (``read_done``), on folders written by hand.

Through ``stare eval`` and a real folder: tests/test_bad_state.py (a resume with other settings, a folder from
before the record, a cut or corrupt samples line; they share its ``evaluated`` folder) and tests/test_eval_harness.py
(a failed start leaves nothing that blocks the retry)."""
import json

import pytest

from stare.eval.batching import BATCHING
from stare.eval.protocols import Protocol
from stare.eval.record import (RECORD, RECORD_KEYS, EvalRefused, check_resume, eval_record, holds_samples,
                               read_done, read_samples, recorded_batching, write_record)

PROTO = Protocol("stare", 2, 1.0, 0.7, 16)


def sample(pid, j):
    return {"problem_id": pid, "sample_idx": j, "response": f"r{pid}{j}"}


def write_samples(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_eval_record_holds_what_the_samples_depend_on(tmp_path):
    rec = eval_record(PROTO, seed=5, model="org/model", bench="aime24", batching="problem")
    assert rec == {"protocol": "stare", "k": 2, "temperature": 1.0, "top_p": 0.7, "max_tokens": 16, "seed": 5,
                   "model": "org/model", "bench": "aime24", "data": None, "tools": None, "batching": "problem",
                   "batching_contract": BATCHING["problem"]}
    assert set(rec) == set(RECORD_KEYS) | {"batching_contract"}
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "sub").mkdir()
    relative = tmp_path / "sub" / ".." / "model"  # a local folder: its full path, so another cwd names the same
    assert eval_record(PROTO, seed=0, model=str(relative), bench="aime24")["model"] == str(folder.resolve())


def test_write_record_writes_the_json_and_leaves_no_temporary_file(tmp_path):
    rec = eval_record(PROTO, seed=1, model="m", bench="aime25", data="/d.jsonl", tools="python")
    write_record(tmp_path, rec)
    assert json.loads((tmp_path / RECORD).read_text()) == rec
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECORD]


def test_holds_samples_needs_a_summary_or_one_whole_sample_line(tmp_path):
    assert not holds_samples(tmp_path / "absent")
    assert not holds_samples(tmp_path)
    write_record(tmp_path, eval_record(PROTO, seed=0, model="m", bench="aime24"))
    assert not holds_samples(tmp_path)  # a record alone: a start that failed before its first problem
    (tmp_path / "samples.jsonl").write_text("")
    assert not holds_samples(tmp_path)
    (tmp_path / "samples.jsonl").write_text('{"problem_id": "a", "sample_idx"')  # the only line, cut by a kill
    assert not holds_samples(tmp_path)
    (tmp_path / "samples.jsonl").write_text('{"problem_id": "a", "sample_idx": 0}\n')
    assert holds_samples(tmp_path)
    (tmp_path / "samples.jsonl").unlink()
    (tmp_path / "summary.json").write_text("{}")
    assert holds_samples(tmp_path)


def test_recorded_batching(tmp_path):
    assert recorded_batching(tmp_path) is None  # nothing there
    write_record(tmp_path, eval_record(PROTO, seed=0, model="m", bench="aime24", batching="all"))
    assert recorded_batching(tmp_path) is None  # a record without samples
    write_samples(tmp_path / "samples.jsonl", [sample("a", 0)])
    assert recorded_batching(tmp_path) == "all"
    (tmp_path / RECORD).unlink()  # samples from before the record: drawn one problem at a time
    assert recorded_batching(tmp_path) == "problem"
    (tmp_path / RECORD).write_text("{broken")  # a corrupt record names none
    assert recorded_batching(tmp_path) is None


def test_read_done_keeps_problems_with_all_k_samples_and_rewrites_the_file(tmp_path):
    path = tmp_path / "samples.jsonl"
    rows = [sample("a", 0), sample("b", 0), sample("a", 1), sample("c", 1), sample("b", 2), sample("c", 0),
            sample(7, 0), sample(7, 1)]
    write_samples(path, rows)
    warnings = []
    done = read_done(path, 2, warnings.append)
    # a: 0 and 1; b: 0 and 2 (1 missing), dropped; c: 1 then 0, sorted; 7: an int id, keyed as its string
    assert done == {"a": [sample("a", 0), sample("a", 1)], "c": [sample("c", 0), sample("c", 1)],
                    "7": [sample(7, 0), sample(7, 1)]}
    assert warnings == []
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    assert kept == [sample("a", 0), sample("a", 1), sample("c", 0), sample("c", 1), sample(7, 0), sample(7, 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["samples.jsonl"]
    assert read_done(tmp_path / "absent.jsonl", 2, warnings.append) == {}


def test_read_done_drops_a_cut_last_line_with_one_warning(tmp_path):
    path = tmp_path / "samples.jsonl"
    write_samples(path, [sample("a", 0), sample("a", 1), sample("b", 0)])
    path.write_text(path.read_text() + '{"problem_id": "b", "sam')
    warnings = []
    assert list(read_done(path, 2, warnings.append)) == ["a"]
    assert len(warnings) == 1 and warnings[0].startswith(f"{path}: the last line was cut")


def test_read_samples_refuses_a_record_without_ids_before_the_last_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    write_samples(path, [sample("a", 0), {"problem_id": "a"}, sample("a", 1)])
    with pytest.raises(EvalRefused, match=rf"^{path} line 2 is corrupt \(not a sample record\)"):
        read_samples(path)
    write_samples(path, [sample("a", 0), {"problem_id": "a"}])
    assert read_samples(path) == ([sample("a", 0)], True)


def test_check_resume_compares_every_recorded_setting(tmp_path):
    old = eval_record(PROTO, seed=0, model="m", bench="aime24", batching="all")
    write_record(tmp_path, old)
    new = dict(old)
    check_resume(tmp_path, {**new, "seed": 9})  # no sample yet: anything starts afresh
    write_samples(tmp_path / "samples.jsonl", [sample("a", 0)])
    check_resume(tmp_path, new)
    for key, value, shown in [("top_p", 0.9, "--top-p 0.9"), ("max_tokens", 32, "--max-tokens 32"),
                              ("model", "other", "--model other"), ("batching", "problem", "--batching problem")]:
        with pytest.raises(EvalRefused, match=rf"^{shown}: {tmp_path} holds samples drawn with {key} {old[key]}; "
                                              "resume with the same settings or use another --out"):
            check_resume(tmp_path, {**new, key: value})
    # data and tools: none recorded is a setting too (a data file or tools added on resume are refused) ...
    with pytest.raises(EvalRefused, match=r"^--data-file /d.jsonl: .* holds samples drawn with data \(none\)"):
        check_resume(tmp_path, {**new, "data": "/d.jsonl"})
    with pytest.raises(EvalRefused, match=r"^--tools python: .* drawn with tools \(none\)"):
        check_resume(tmp_path, {**new, "tools": "python"})
    # ... while another setting recorded as none is not compared
    write_record(tmp_path, {**old, "max_tokens": None, "tools": "python"})
    check_resume(tmp_path, {**new, "max_tokens": 99, "tools": "python"})
    with pytest.raises(EvalRefused, match=r"^--tools \(none\): .* drawn with tools python"):
        check_resume(tmp_path, new)


def test_check_resume_refuses_a_corrupt_record(tmp_path):
    write_samples(tmp_path / "samples.jsonl", [sample("a", 0)])
    (tmp_path / RECORD).write_text("{broken")
    with pytest.raises(EvalRefused, match=rf"^{tmp_path / RECORD} is corrupt"):
        check_resume(tmp_path, eval_record(PROTO, seed=0, model="m", bench="aime24"))
