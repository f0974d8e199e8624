import json
import os

import pytest

from areal_core.data.records import Record, RecordError, read_records, write_records

RECORDS = [
    Record(id="c1", task="chain", prompt="a3b5=", answer="8", solution="a3b8|8", meta={"k": 2}),
    Record(id="m1", task="math", prompt="What is 2+2?", answer="4", source="hand", meta={"level": 1, "tags": ["x"]}),
    Record(
        id="p1",
        task="code",
        prompt="Write f(x) returning x+1.",
        tests=[
            {"testtype": "functional", "input": "1", "output": "2", "fn_name": "f"},
            {"testtype": "functional", "input": "5", "output": "6", "fn_name": "f"},
        ],
    ),
]


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_round_trip(tmp_path, ext):
    path = tmp_path / f"recs.{ext}"
    write_records(RECORDS, str(path))
    assert read_records(str(path)) == RECORDS
    assert read_records(f"file://{path}") == RECORDS
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left


def test_round_trip_fsspec_memory():
    url = "memory://areal-flow-test/recs.jsonl"
    write_records(RECORDS, url)
    assert read_records(url) == RECORDS


def test_dict_rows_validated_on_write(tmp_path):
    path = tmp_path / "r.jsonl"
    write_records([r.model_dump() for r in RECORDS], str(path))
    assert read_records(str(path)) == RECORDS
    with pytest.raises(RecordError, match=r"record 0.*field 'task'"):
        write_records([{"id": "x", "task": "poem", "prompt": "p"}], str(path))


def _write_lines(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


GOOD = {"id": "a", "task": "chain", "prompt": "a1b2=", "answer": "3"}


def test_jsonl_missing_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write_lines(path, [GOOD, GOOD, {"id": "b", "task": "chain"}])
    with pytest.raises(RecordError) as e:
        read_records(str(path))
    msg = str(e.value)
    assert str(path) in msg and "line 3" in msg and "'prompt'" in msg and "missing" in msg.lower()


def test_jsonl_wrong_type(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write_lines(path, [GOOD, {**GOOD, "answer": 3}])
    with pytest.raises(RecordError) as e:
        read_records(str(path))
    msg = str(e.value)
    assert str(path) in msg and "line 2" in msg and "'answer'" in msg and "string" in msg


def test_jsonl_bad_task_and_extra_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write_lines(path, [{**GOOD, "task": "poem"}])
    with pytest.raises(RecordError, match=r"line 1.*field 'task'.*'chain'"):
        read_records(str(path))
    _write_lines(path, [{**GOOD, "difficulty": 3}])
    with pytest.raises(RecordError, match=r"line 1.*field 'difficulty'"):
        read_records(str(path))


def test_jsonl_invalid_json(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write_lines(path, [GOOD, "{not json", GOOD])
    with pytest.raises(RecordError) as e:
        read_records(str(path))
    msg = str(e.value)
    assert str(path) in msg and "line 2" in msg and "invalid JSON" in msg


def test_jsonl_non_object_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write_lines(path, ["[1, 2]"])
    with pytest.raises(RecordError, match=r"line 1.*JSON object"):
        read_records(str(path))


def test_parquet_bad_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "bad.parquet"
    table = pa.Table.from_pylist(
        [GOOD, {"id": "b", "task": "chain", "prompt": None, "answer": "1"}],
        schema=pa.schema(
            [("id", pa.string()), ("task", pa.string()), ("prompt", pa.string()), ("answer", pa.string())]
        ),
    )
    pq.write_table(table, path)
    with pytest.raises(RecordError) as e:
        read_records(str(path))
    msg = str(e.value)
    assert str(path) in msg and "row 1" in msg and "'prompt'" in msg


def test_parquet_missing_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "a", "task": "chain"}]), path)
    with pytest.raises(RecordError, match=r"row 0.*field 'prompt'.*missing"):
        read_records(str(path))


def test_unknown_extension_and_missing_file(tmp_path):
    with pytest.raises(RecordError, match=r"jsonl or .parquet"):
        read_records(str(tmp_path / "x.csv"))
    with pytest.raises(RecordError, match="no such records file"):
        read_records(str(tmp_path / "absent.jsonl"))


def test_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    path = tmp_path / "out.jsonl"
    write_records(RECORDS[:1], str(path))
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        write_records(RECORDS, str(path))
    assert path.read_bytes() == before  # old content intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]

    fresh = tmp_path / "fresh.parquet"
    with pytest.raises(OSError, match="disk full"):
        write_records(RECORDS, str(fresh))
    assert not fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_non_utf8_line_names_file_and_line(tmp_path):
    from areal_core.data.records import RecordError, read_records

    p = tmp_path / "rows.jsonl"
    p.write_bytes(b'{"id": "a", "task": "chain", "prompt": "a1=", "answer": "1"}\n{"id": "\xff"}\n')
    with pytest.raises(RecordError, match=r"rows.jsonl, line 2: not valid UTF-8"):
        read_records(str(p))


CODE = {
    "id": "lcb/7",
    "task": "code",
    "prompt": "Write f.",
    "tests": [{"testtype": "functional", "input": "1\n[2, 3]", "output": "6", "fn_name": "f"}],
}


@pytest.mark.parametrize(
    "test,field,what",
    [
        ({"testtype": "functional", "input": "1", "output": "2"}, "tests.0.fn_name", "expected a string, got missing"),
        ({"testtype": "functional", "input": "[1,", "output": "2", "fn_name": "f"}, "tests.0.input", "expected JSON"),
        ({"testtype": "functional", "input": "1", "output": "two", "fn_name": "f"}, "tests.0.output", "expected JSON"),
        (
            {"testtype": "functional", "input": "1", "output": "2", "fn_name": "not a name"},
            "tests.0.fn_name",
            "expected a Python name",
        ),
        ({"testtype": "stdin", "input": 1, "output": "2"}, "tests.0.input", "expected a string, got int"),
        ({"testtype": "assert", "code": "assert f(1) =="}, "tests.0.code", "does not parse"),
        (
            {"testtype": "assert", "code": "assert f(1) == 2", "prefix": "def f(x) return"},
            "tests.0.prefix",
            "does not parse",
        ),
        ({"testtype": "unit", "input": "1", "output": "2"}, "tests.0.testtype", "expected one of stdin, functional"),
        ({"input": "1", "output": "2"}, "tests.0.testtype", "got missing"),
        ({"testtype": "stdin", "input": "1", "output": "2", "fn_name": "f"}, "tests.0", "unknown field(s) ['fn_name']"),
        ("assert f(1) == 2", "tests.0", "valid dictionary"),
    ],
)
def test_malformed_test_case_names_file_line_record_and_field(tmp_path, test, field, what):
    path = tmp_path / "code.jsonl"
    _write_lines(path, [CODE, {**CODE, "id": "lcb/8", "tests": [test]}])
    with pytest.raises(RecordError) as e:
        read_records(str(path))
    msg = str(e.value)
    assert msg.startswith(f"{path}, line 2 (record 'lcb/8'): field '{field}'"), msg
    assert what in msg, msg


def test_code_records_need_tests_of_one_kind_and_only_code_records_carry_tests(tmp_path):
    path = tmp_path / "code.jsonl"
    stdin = {"testtype": "stdin", "input": "1", "output": "2"}
    for row, what in [
        ({**CODE, "tests": None}, "a code problem needs at least one test"),
        ({**CODE, "tests": []}, "a code problem needs at least one test"),
        ({**CODE, "tests": CODE["tests"] + [stdin]}, "the tests of one problem must share one testtype"),
        ({**GOOD, "tests": [stdin]}, "only code records carry tests"),
    ]:
        _write_lines(path, [row])
        with pytest.raises(RecordError, match=rf"line 1 \(record '\w+(/7)?'\): field 'tests': {what}"):
            read_records(str(path))


def test_malformed_test_case_in_parquet_names_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "code.parquet"
    bad = {**CODE, "id": "lcb/9", "tests": json.dumps([{"testtype": "stdin", "input": "1"}])}
    rows = [{**CODE, "tests": json.dumps(CODE["tests"])}, bad]
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([(k, pa.string()) for k in bad])), path)
    with pytest.raises(
        RecordError,
        match=r"code\.parquet, row 1 \(record 'lcb/9'\): field 'tests\.0\.output': "
        r"expected a string, got missing",
    ):
        read_records(str(path))


def test_a_reader_or_generator_cannot_build_a_bad_code_record():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="fn_name"):
        Record(id="x", task="code", prompt="p", tests=[{"testtype": "functional", "input": "1", "output": "2"}])
