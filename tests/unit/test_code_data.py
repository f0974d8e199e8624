"""Code training data: the LiveCodeBench and LeetCode train splits as records with their tests and
provenance (the prepare-data path), kept apart from the evaluation sets, and the synthetic code task."""

from __future__ import annotations

import collections
import hashlib
import json
import re

import pytest

from areal_core.data.overlap import EvalProblems, entry_point, split_off_overlaps, statement_key
from areal_core.data.prepare import prepare
from areal_core.data.records import Record, RecordError, read_records
from areal_core.data.sources import CODE_BENCHMARKS, SOURCES, read_source, source_path

TRAIN_COUNTS = {"livecodebench_train": 580, "leetcode_train": 1889}
needs_train_files = pytest.mark.skipif(
    not all(__import__("os").path.exists(source_path(n)) for n in TRAIN_COUNTS),
    reason="the train splits are not shipped: they are read from ../shared/data (data/SOURCES.md)",
)


@pytest.fixture(scope="module")
def eval_records() -> list[Record]:
    return [r for name in CODE_BENCHMARKS for r in read_source(name)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("prepared")
    return {name: prepare(name, str(out / name), fmt="jsonl") for name in TRAIN_COUNTS}


@needs_train_files
@pytest.mark.parametrize("name,count", sorted(TRAIN_COUNTS.items()))
def test_train_splits_read_with_their_tests(name, count):
    records = read_source(name)
    assert len(records) == count and len({r.id for r in records}) == count
    kinds = collections.Counter(r.tests[0]["testtype"] for r in records)
    assert all(r.task == "code" and r.tests and r.source == name for r in records)
    if name == "livecodebench_train":  # data/SOURCES.md: 303 stdin, 277 functional
        assert kinds == {"stdin": 303, "functional": 277}
        assert all(r.meta["public_tests_only"] for r in records)
    else:
        assert kinds == {"assert": count} and all(r.solution for r in records)


@needs_train_files
def test_prepare_writes_records_with_provenance_and_leaves_out_evaluation_problems(prepared):
    for name, m in prepared.items():
        records = read_records(m["files"][name])
        left_out = m["left_out_as_evaluation_problems"]
        assert m["counts"] == {name: len(records)} and len(records) + len(left_out) == TRAIN_COUNTS[name]
        assert {r.id for r in records}.isdisjoint(d["train_id"] for d in left_out)
        with open(source_path(name), "rb") as f:
            assert m["sha256"] == hashlib.sha256(f.read()).hexdigest()
        assert m["origin"] == SOURCES[name].origin and "@" in m["origin"] and m["file"] == source_path(name)
        assert all(r.tests and r.source == name for r in records)
    lcb = prepared["livecodebench_train"]["left_out_as_evaluation_problems"]
    # 109 of its problems are LeetCode test problems word for word (after normalising), a few more reworded
    assert sum(d["why"] == "same statement" for d in lcb) == 109 and len(lcb) == 115
    by_train = {d["train_id"]: d for d in lcb}
    assert by_train["livecodebench_train/95"]["eval_id"] == "leetcode/8"  # reworded by LeetCode since
    assert by_train["livecodebench_train/573"]["eval_id"] == "livecodebench/6"  # Alternating Groups I vs III
    assert len(prepared["leetcode_train"]["left_out_as_evaluation_problems"]) == 1


@needs_train_files
def test_no_prepared_train_problem_is_an_evaluation_problem(prepared, eval_records):
    """By id, by normalised statement, and (independently of the rule that left problems out)
    by the statement's opening: its first 80 letters and digits with the same entry point, or its
    first 300 (stdin problems have no entry point, and AtCoder's open with stock sentences)."""
    eval_ids = {r.id for r in eval_records}
    eval_keys = {statement_key(r.prompt) for r in eval_records}

    def opening(r: Record) -> str:
        return statement_key(r.prompt)[: 80 if entry_point(r) else 300]

    eval_openings = {(entry_point(r), opening(r)) for r in eval_records}
    for name, m in prepared.items():
        train = read_records(m["files"][name])
        assert not {r.id for r in train} & eval_ids
        assert not {statement_key(r.prompt) for r in train} & eval_keys
        assert not {(entry_point(r), opening(r)) for r in train} & eval_openings
        # and the train split, read raw, did share statements with the evaluation sets
        if name == "livecodebench_train":
            assert {statement_key(r.prompt) for r in read_source(name)} & eval_keys


def test_overlap_sees_through_formatting_and_rewording():
    stmt = (
        "You are given a 0-indexed integer array nums and an integer k. Return the number of subarrays "
        "whose sum is divisible by k, where a subarray is a contiguous non-empty sequence of elements."
    )
    held = [
        Record(
            id="leetcode/1",
            task="code",
            prompt=stmt,
            tests=[
                {
                    "testtype": "assert",
                    "code": "def check(candidate):\n    assert candidate([1], 1) == 1\n\n"
                    "check(Solution().countDivisible)",
                    "entry_point": "Solution",
                }
            ],
        )
    ]
    dressed = (
        "Please solve the programming task below using a self-contained code snippet in a markdown code "
        "block.\n\n"
        + stmt.upper().replace(" ", "  ").replace("0-indexed", "0 - indexed")
        + "\n\nExample 1:\nInput: nums = [4,5], k = 5\nOutput: 1\n\nPlease complete the following python "
        "code precisely:\n```python\nclass Solution:\n    def countDivisible(self, nums, k):\n```"
    )
    subscripts = stmt.replace("nums and", "nums_i and")  # LiveCodeBench writes a_i where LeetCode writes ai
    edited = stmt.replace("Return the number", "Please return how many") + " Each element is positive."
    other = (
        "There is a tree with n nodes labelled from 1 to n; return the length of its longest path "
        "whose node values are all distinct."
    )
    func = [{"testtype": "functional", "input": "[1]\n1", "output": "1", "fn_name": "f"}]
    train = [
        Record(id=f"t/{i}", task="code", prompt=p, tests=func)
        for i, p in enumerate([dressed, subscripts, edited, other])
    ]
    kept, dropped = split_off_overlaps(train, held)
    assert [r.id for r in kept] == ["t/3"]
    assert [(d.train_id, d.eval_id) for d in dropped] == [
        ("t/0", "leetcode/1"),
        ("t/1", "leetcode/1"),
        ("t/2", "leetcode/1"),
    ]
    assert dropped[0].why == "same statement" and re.fullmatch(r"shared text \d+%", dropped[2].why)
    assert EvalProblems(held).match(Record(id="leetcode/1", task="code", prompt="x", tests=func)).why == "same id"


@needs_train_files
def test_leetcode_train_reference_solutions_pass_their_tests(prepared):
    from areal_core.reward.code import grade_code

    records = read_records(prepared["leetcode_train"]["files"]["leetcode_train"])
    for r in records[::200]:  # ten of them, across the file
        result = grade_code(r.solution, r.tests)
        assert result.passed, (r.id, result.reason)


def test_a_train_file_with_a_malformed_test_is_a_clear_error(tmp_path):
    path = tmp_path / "train_livecodebench.json"
    path.write_text(
        json.dumps(
            [
                {
                    "problem": "p",
                    "starter_code": "class Solution:\n    def f(self, x):\n",
                    "tests": [{"input": "1", "output": "2", "testtype": "functional"}],
                },
                {
                    "problem": "q",
                    "starter_code": "class Solution:\n    def g(self, x):\n",
                    "tests": [{"input": "[1,", "output": "2", "testtype": "functional"}],
                },
            ]
        )
    )
    with pytest.raises(
        RecordError,
        match=r"train_livecodebench\.json, row 1 \(record 'livecodebench_train/1'\): "
        r"field 'tests\.0\.input': expected JSON",
    ):
        read_source("livecodebench_train", str(path))
    with pytest.raises(RecordError, match=r"row 1 \(record 'livecodebench_train/1'\)"):
        prepare("livecodebench_train", str(tmp_path / "out"), path=str(path))
    assert not (tmp_path / "out").exists()


# the synthetic code task ------------------------------------------------------------------


def _task(**kw):
    from areal_core.data.config import SyntheticCodeTask
    from areal_core.data.synthetic_code import FunctionTask

    return FunctionTask(SyntheticCodeTask(kind="code", **kw))


def test_synthetic_code_task_splits_and_reference_programs():
    from areal_core.reward.code import grade_code

    task = _task(n_train=3000, n_eval=300)
    train, held_out = task.train_records(), task.eval_records()
    fn = lambda r: (tuple(r.meta["coefs"]), r.meta["const"])  # noqa: E731
    assert not {fn(r) for r in train} & {fn(r) for r in held_out}  # no held-out function is trained on
    assert [r.prompt for r in _task(n_train=3000, n_eval=300).train_records()] == [r.prompt for r in train]
    ks = collections.Counter(r.meta["k"] for r in train)
    assert set(ks) == {1, 2, 3, 4} and ks[1] > ks[2] > ks[3] > ks[4]  # P(k) ~ 1/k
    r = next(r for r in train if r.meta["k"] == 2)
    (a, b), c = r.meta["coefs"], r.meta["const"]
    assert r.prompt == f"f(0,0)={c},f(1,0)={a + c},f(0,1)={b + c}?"
    assert r.solution == f"def f(x,y): return x*({a + c}-{c})+y*({b + c}-{c})+{c}"
    assert len(r.tests) == 3 + 3 and {t["fn_name"] for t in r.tests} == {"f"}
    for rec in held_out[:6]:
        assert grade_code(rec.solution, rec.tests).passed
    # the shown values alone do not pass: three tests are hidden
    entries = ",".join(f"({t['input'].replace(chr(10), ',')},): {t['output']}" for t in r.tests[:3])
    table = f"def f(*a):\n    return {{{entries}}}[a]"
    assert not grade_code(table, r.tests).passed


def test_synthetic_code_prompts_survive_a_saved_tokenizer(tmp_path):
    """Prompts are encoded by the tokenizer a checkpoint carries: they must come out as the
    character tokenizer encodes them."""
    import transformers

    from areal_core.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    for r in _task(n_train=200, n_eval=10).train_records():
        assert loaded.encode(r.prompt, add_special_tokens=False) == tok.encode(r.prompt, add_special_tokens=False)


def test_prepare_writes_the_synthetic_code_task(tmp_path):
    m = prepare(
        "synthetic",
        str(tmp_path / "code"),
        fmt="jsonl",
        synthetic={"kind": "code", "n_train": 50, "n_eval": 10, "max_args": 2},
    )
    assert m["counts"] == {"train": 50, "eval": 10}
    train = read_records(m["files"]["train"])
    assert all(r.task == "code" and r.tests and r.meta["k"] in (1, 2) for r in train)
