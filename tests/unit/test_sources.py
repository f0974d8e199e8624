"""Readers of the shipped benchmark files: counts, fields, and clear errors on bad rows."""

import gzip
import json

import pytest

from areal_core.data.records import RecordError
from areal_core.data.sources import DATA_DIR, SOURCES, read_source

SHIPPED_COUNTS = {
    "gsm8k": 1319,
    "math500": 500,
    "aime24": 30,
    "aime25": 30,
    "livecodebench": 279,
    "humaneval": 164,
    "leetcode": 200,
    "deepscaler_subset": 1208,
}


@pytest.mark.parametrize("name,count", sorted(SHIPPED_COUNTS.items()))
def test_shipped_sources_read_completely(name, count):
    records = read_source(name)
    assert len(records) == count
    assert len({r.id for r in records}) == count
    for r in records:
        assert r.prompt.strip()
        if r.task == "math":
            assert r.answer.strip() and r.answer != "None"
        else:
            assert r.task == "code" and r.tests


def test_every_shipped_file_is_in_the_registry_and_sources_md():
    sources_md = (DATA_DIR / "SOURCES.md").read_text()
    for name, src in SOURCES.items():
        if src.shipped:
            assert (DATA_DIR / src.default_file).exists(), name
            assert src.default_file in sources_md, name


def test_field_conversions():
    gsm = read_source("gsm8k")[0]
    assert gsm.answer == "18" and gsm.solution.endswith("#### 18")
    aime25 = read_source("aime25")[0]
    assert aime25.answer == "70" and "Please reason step by step" not in aime25.prompt
    lcb = read_source("livecodebench")
    kinds = {t["testtype"] for r in lcb for t in r.tests}
    assert kinds == {"stdin", "functional"}
    assert all(r.meta["public_tests_only"] for r in lcb)
    functional = next(r for r in lcb if r.tests[0]["testtype"] == "functional")
    assert functional.tests[0]["fn_name"] in functional.meta["starter_code"]
    he = read_source("humaneval")[0]
    assert he.id == "HumanEval/0" and he.tests[0]["code"].rstrip().endswith("check(has_close_elements)")


def test_bad_rows_name_file_line_and_field(tmp_path):
    p = tmp_path / "gsm.jsonl"
    p.write_text(json.dumps({"question": "q", "answer": "#### 3"}) + "\n" + json.dumps({"question": "q2"}) + "\n")
    with pytest.raises(RecordError, match=r"gsm\.jsonl, line 2: field 'answer': expected a non-empty string"):
        read_source("gsm8k", str(p))
    p.write_text(json.dumps({"question": "q", "answer": "no hashes"}) + "\n")
    with pytest.raises(RecordError, match=r"line 1: field 'answer': expected a worked solution"):
        read_source("gsm8k", str(p))
    m = tmp_path / "math.jsonl"
    m.write_text(json.dumps({"problem": "p", "answer": 3}) + "\n" + json.dumps({"problem": "p", "answer": ""}) + "\n")
    with pytest.raises(RecordError, match=r"math\.jsonl, line 2: field 'answer': expected a non-empty answer"):
        read_source("math500", str(m))
    bad_json = tmp_path / "x.jsonl"
    bad_json.write_text('{"problem": "p", "answer": 1}\n{oops\n')
    with pytest.raises(RecordError, match=r"x\.jsonl, line 2: invalid JSON"):
        read_source("aime24", str(bad_json))
    lcb = tmp_path / "lcb.json"
    lcb.write_text(json.dumps([{"problem": "p", "starter_code": "", "tests": [{"input": 1, "output": "2"}]}]))
    with pytest.raises(RecordError, match=r"lcb\.json, row 0: field 'tests'"):
        read_source("livecodebench", str(lcb))
    he = tmp_path / "he.jsonl.gz"
    with gzip.open(he, "wt") as f:
        f.write(json.dumps({"task_id": "x", "prompt": "def f():\n", "entry_point": "f", "test": ""}) + "\n")
    with pytest.raises(RecordError, match=r"line 1: field 'test'"):
        read_source("humaneval", str(he))
    arr = tmp_path / "lc.json"
    arr.write_text(json.dumps([["not", "an", "object"]]))
    with pytest.raises(RecordError, match=r"lc\.json, row 0: expected a JSON object"):
        read_source("leetcode", str(arr))


def test_unknown_source_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown data source"):
        read_source("nope")
    with pytest.raises(RecordError, match="no such file"):
        read_source("gsm8k", str(tmp_path / "missing.jsonl"))
