"""Readers for the public benchmark and training files in data/ (see data/SOURCES.md).

``read_source(name, path=None)`` turns one file into :class:`Record` s. A row
that does not have what the format promises raises :class:`RecordError`
naming the file, the line (jsonl: 1-based line; json array / parquet: 0-based
row), the field and what was expected.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from areal_core.data.records import Record, RecordError, describe_validation_error

DATA_DIR = Path(__file__).resolve().parents[2] / "data"
SHARED_DATA_DIR = DATA_DIR.parents[1] / "shared" / "data"  # files not shipped: a shared/data folder next to the repo's
# the call a LeetCode check() program ends with: check(Solution().method) takes Solution from the program
_CHECK_CALL = re.compile(r"^check\(\s*([A-Za-z_]\w*)", re.MULTILINE)
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_QWQ_SUFFIX = "\n" + MATH_INSTRUCTION
_DSR_SUFFIX = " Let's think step by step and output the final answer within \\boxed{}."
STDIN_CODE_INSTRUCTION = (
    "Write a Python 3 program that reads the input from standard input and writes the answer to standard "
    "output. Put the whole program in one ```python code block."
)
FUNCTIONAL_CODE_INSTRUCTION = "Complete the code below. Put the whole solution in one ```python code block."


class _Row:
    """One raw row and where it came from, for error messages."""

    def __init__(self, data, where: str):
        if not isinstance(data, dict):
            raise RecordError(f"{where}: expected a JSON object (one problem), got {type(data).__name__}")
        self.data, self.where = data, where

    def fail(self, field: str, expected: str) -> RecordError:
        got = self.data.get(field, "<missing>")
        return RecordError(f"{self.where}: field '{field}': expected {expected}, got {str(got)[:80]!r}")

    def record(self, **fields) -> Record:
        """The row as a :class:`Record`; one that fails validation names this row."""
        try:
            return Record(**fields)
        except ValidationError as e:
            raise RecordError(f"{self.where} (record {fields.get('id')!r}): {describe_validation_error(e)}") from None

    def text(self, field: str) -> str:
        v = self.data.get(field)
        if not isinstance(v, str) or not v.strip():
            raise self.fail(field, "a non-empty string")
        return v

    def answer(self, field: str) -> str:
        """A reference answer: a non-empty string or an integer (AIME)."""
        v = self.data.get(field)
        if isinstance(v, bool) or not isinstance(v, (str, int)) or not str(v).strip() or str(v).strip() == "None":
            raise self.fail(field, "a non-empty answer (string or integer)")
        return str(v).strip()


def _jsonl(path: str) -> Iterator[_Row]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield _Row(json.loads(line), f"{path}, line {lineno}")
            except json.JSONDecodeError as e:
                raise RecordError(f"{path}, line {lineno}: invalid JSON ({e.msg})") from None


def _json_array(path: str) -> Iterator[_Row]:
    with open(path, encoding="utf-8") as f:
        try:
            rows = json.load(f)
        except json.JSONDecodeError as e:
            raise RecordError(f"{path}, line {e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(rows, list):
        raise RecordError(f"{path}: expected a JSON array of problems, got {type(rows).__name__}")
    for i, row in enumerate(rows):
        yield _Row(row, f"{path}, row {i}")


def _parquet(path: str) -> Iterator[_Row]:
    import pyarrow.parquet as pq

    for i, row in enumerate(pq.read_table(path).to_pylist()):
        yield _Row(row, f"{path}, row {i}")


def _rows(path: str) -> Iterator[_Row]:
    if path.endswith(".parquet"):
        return _parquet(path)
    if path.endswith(".json"):
        return _json_array(path)
    return _jsonl(path)


def _gsm8k(path: str, name: str) -> list[Record]:
    out = []
    for i, row in enumerate(_rows(path)):
        worked = row.text("answer")
        if "####" not in worked:
            raise row.fail("answer", "a worked solution ending in '#### <number>'")
        final = worked.rsplit("####", 1)[1].strip().replace(",", "")
        if not re.fullmatch(r"-?\d+(\.\d+)?", final):
            raise row.fail("answer", "a number after '####'")
        out.append(
            row.record(
                id=f"{name}/{i}", task="math", prompt=row.text("question"), answer=final, solution=worked, source=name
            )
        )
    return out


def _math_problems(path: str, name: str) -> list[Record]:
    """MATH-500, AIME24, MATH train: problem + answer (+ solution, metadata)."""
    out = []
    for i, row in enumerate(_rows(path)):
        d = row.data
        if name == "math_train" and str(d.get("answer", "")).strip() in ("", "None"):
            continue  # 4 known rows without an answer: nothing to grade against (data/SOURCES.md)
        rid = d.get("unique_id") or d.get("id")
        meta = {k: d[k] for k in ("subject", "level", "type", "difficulty", "url") if k in d}
        out.append(
            row.record(
                id=f"{name}/{rid if rid is not None else i}",
                task="math",
                prompt=row.text("problem"),
                answer=row.answer("answer"),
                solution=d.get("solution") or None,
                source=name,
                meta=meta,
            )
        )
    return out


def _aime25(path: str, name: str) -> list[Record]:
    """The QwQ copy (prompt ends with the math instruction) or the AReaL copy (problem, id)."""
    out = []
    for i, row in enumerate(_rows(path)):
        if "prompt" in row.data:
            prompt = row.text("prompt")
            prompt = prompt[: -len(_QWQ_SUFFIX)] if prompt.endswith(_QWQ_SUFFIX) else prompt
        else:
            prompt = row.text("problem")
        out.append(row.record(id=f"{name}/{i}", task="math", prompt=prompt, answer=row.answer("answer"), source=name))
    return out


def _deepscaler(path: str, name: str) -> list[Record]:
    out = []
    for i, row in enumerate(_rows(path)):
        msgs = row.data.get("prompt")
        if not isinstance(msgs, list) or not msgs or not isinstance(msgs[-1], dict) or "content" not in msgs[-1]:
            raise row.fail("prompt", "a list of chat messages with 'content'")
        prompt = msgs[-1]["content"]
        prompt = prompt[: -len(_DSR_SUFFIX)] if prompt.endswith(_DSR_SUFFIX) else prompt
        truth = (row.data.get("reward_model") or {}).get("ground_truth")
        if not isinstance(truth, str) or not truth.strip():
            continue  # 1 known row with an empty ground truth (data/SOURCES.md)
        out.append(row.record(id=f"{name}/{i}", task="math", prompt=prompt, answer=truth.strip(), source=name))
    return out


def _fn_name(starter: str) -> str | None:
    names = re.findall(r"def\s+([A-Za-z_]\w*)\s*\(", starter)
    return names[-1] if names else None


def _code_prompt(problem: str, starter: str) -> str:
    if starter.strip():
        return f"{problem.rstrip()}\n\n{FUNCTIONAL_CODE_INSTRUCTION}\n```python\n{starter.rstrip()}\n```"
    return f"{problem.rstrip()}\n\n{STDIN_CODE_INSTRUCTION}"


def _livecodebench(path: str, name: str) -> list[Record]:
    out = []
    for i, row in enumerate(_rows(path)):
        problem = row.text("problem")
        starter = row.data.get("starter_code") or ""
        raw = row.data.get("tests")
        if not isinstance(raw, list) or not raw:
            raise row.fail("tests", "a non-empty list of {input, output, testtype}")
        tests = []
        for t in raw:
            if not isinstance(t, dict) or not isinstance(t.get("input"), str) or not isinstance(t.get("output"), str):
                raise row.fail("tests", "tests with string 'input' and 'output'")
            kind = t.get("testtype", "stdin")
            if kind == "functional":
                fn = _fn_name(starter)
                if fn is None:
                    raise row.fail("starter_code", "a starter function for functional tests")
                tests.append({"testtype": "functional", "input": t["input"], "output": t["output"], "fn_name": fn})
            elif kind == "stdin":
                tests.append({"testtype": "stdin", "input": t["input"], "output": t["output"]})
            else:
                raise row.fail("tests", "testtype 'stdin' or 'functional'")
        out.append(
            row.record(
                id=f"{name}/{i}",
                task="code",
                prompt=_code_prompt(problem, starter),
                tests=tests,
                source=name,
                meta={"public_tests_only": True, "starter_code": starter},
            )
        )
    return out


def _humaneval(path: str, name: str) -> list[Record]:
    out = []
    for row in _rows(path):
        stub, entry = row.text("prompt"), row.text("entry_point")
        test = row.text("test") + f"\n\ncheck({entry})\n"
        prompt = (
            f"Complete the following Python function.\n```python\n{stub.rstrip()}\n```\nReturn the complete "
            "function (with any imports it needs) in one ```python code block."
        )
        out.append(
            row.record(
                id=row.text("task_id"),
                task="code",
                prompt=prompt,
                solution=stub + row.text("canonical_solution"),
                tests=[{"testtype": "assert", "code": test, "prefix": stub, "entry_point": entry}],
                source=name,
                meta={"entry_point": entry},
            )
        )
    return out


def _leetcode(path: str, name: str) -> list[Record]:
    out = []
    for i, row in enumerate(_rows(path)):
        tests = row.data.get("tests")
        if not isinstance(tests, dict) or not isinstance(tests.get("functional"), str):
            raise row.fail("tests", "an object with a 'functional' check() program")
        called = _CHECK_CALL.findall(tests["functional"])
        if not called:
            raise row.fail("tests", "a check() program ending in check(NAME...) (NAME: what it takes from the program)")
        out.append(
            row.record(
                id=f"{name}/{i}",
                task="code",
                prompt=row.text("problem"),
                solution=row.text("solutions"),
                tests=[{"testtype": "assert", "code": tests["functional"], "entry_point": called[-1]}],
                source=name,
            )
        )
    return out


def _codeforces(path: str, name: str) -> list[Record]:
    out = []
    for i, row in enumerate(_rows(path)):
        raw = row.data.get("tests")
        if (
            not isinstance(raw, list)
            or not raw
            or not all(
                isinstance(t, dict) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str)
                for t in raw
            )
        ):
            raise row.fail("tests", "a non-empty list of {input, output} strings")
        tests = [{"testtype": "stdin", "input": t["input"], "output": t["output"]} for t in raw]
        out.append(
            row.record(
                id=f"{name}/{i}", task="code", prompt=_code_prompt(row.text("problem"), ""), tests=tests, source=name
            )
        )
    return out


@dataclass(frozen=True)
class Source:
    reader: Callable[[str, str], list[Record]]
    default_file: str  # relative to data/ in the repo, or (not shipped) to SHARED_DATA_DIR
    shipped: bool  # copied into the repo's data/ folder
    origin: str  # where the file was copied from: repo : path @ commit (blob); data/SOURCES.md has the licenses
    # a training set: the evaluation sources it must share no problem with (areal_core.data.overlap);
    # `prepare` leaves out the problems that are also in one of them
    held_out_from: tuple[str, ...] = ()


_RLLM = "agentica-project/rllm : rllm/data/{} @ 874daa4acb7f451dc2a4b2b6e8ce28f5aa88d1f5 (blob {})"
_RLLM_5255 = "rllm-org/rllm : rllm/data/{} @ 5255304e87b07e6e81e7c61d9dac3e4f160ec6a9 (blob {})"
CODE_BENCHMARKS = ("livecodebench", "leetcode", "humaneval")

SOURCES: dict[str, Source] = {
    "gsm8k": Source(
        _gsm8k,
        "gsm8k/test.jsonl",
        True,
        "openai/grade-school-math : grade_school_math/data/test.jsonl "
        "@ 3101c7d5072418e28b9008a6636bde82a006892c (blob e4c2ff49)",
    ),
    "math500": Source(
        _math_problems,
        "math500/test.jsonl",
        True,
        "inclusionAI/AReaL : evaluation/data/math_500/"
        "test.jsonl @ f55fe685c661b0117d888fcae47d6f46e9a85087 (blob 2376b9a1)",
    ),
    "aime24": Source(
        _math_problems,
        "aime24/test.jsonl",
        True,
        "QwenLM/Qwen2.5-Math : evaluation/data/aime24/"
        "test.jsonl @ a45202bd16f1ec06f433442dc1152d0074773465 (blob bb72e176)",
    ),
    "aime25": Source(
        _aime25,
        "aime25/qwq_aime25.jsonl",
        True,
        "QwenLM/QwQ : eval/data/aime25.jsonl @ 620a5eadc89ff464d339367dd9c9973a93215c81 (blob 5c22e0f4)",
    ),
    "math_train": Source(
        _math_problems, "math_train/math.json", False, _RLLM.format("train/math/math.json", "c923136f")
    ),
    "deepscaler_subset": Source(
        _deepscaler,
        "deepscaler_subset/dsr_sub.parquet",
        True,
        "ypwang61/One-Shot-RLVR : "
        "data/train/one_shot_rlvr/dsr_sub.parquet @ 21ed529ec90002597c92aee957af1dd8166bb66c "
        "(blob 8199b691)",
    ),
    "livecodebench": Source(
        _livecodebench,
        "livecodebench/test_livecodebench.json",
        True,
        _RLLM_5255.format("test/code/livecodebench.json", "fae91d6e"),
    ),
    "humaneval": Source(
        _humaneval,
        "humaneval/HumanEval.jsonl.gz",
        True,
        "openai/human-eval : data/HumanEval.jsonl.gz @ 6d43fb980f9fee3c892a914eda09951f772ad10d (blob 998d2519)",
    ),
    "leetcode": Source(
        _leetcode, "leetcode/test_leetcode.json", True, _RLLM.format("test/code/leetcode.json", "05bcf223")
    ),
    "codeforces": Source(
        _codeforces, "codeforces/test_codeforces.json", False, _RLLM.format("test/code/codeforces.json", "6454c1ee")
    ),
    "livecodebench_train": Source(
        _livecodebench,
        "livecodebench/train_livecodebench.json",
        False,
        _RLLM_5255.format("train/code/livecodebench.json", "5ad514db"),
        CODE_BENCHMARKS,
    ),
    "leetcode_train": Source(
        _leetcode,
        "leetcode/train_leetcode.json",
        False,
        _RLLM.format("train/code/leetcode.json", "3a11291d"),
        CODE_BENCHMARKS,
    ),
}


def source_path(name: str) -> str:
    """Where source ``name``'s file is read from by default: data/ in the repo, else (for a file not
    shipped) a ``shared/data`` folder next to the repository's folder (:data:`SHARED_DATA_DIR`)."""
    src = SOURCES[name]
    shipped_copy = DATA_DIR / src.default_file
    if src.shipped or shipped_copy.exists():
        return str(shipped_copy)
    return str(SHARED_DATA_DIR / src.default_file)


def read_source(name: str, path: str | None = None) -> list[Record]:
    """Records of source ``name`` read from ``path`` (default: :func:`source_path`)."""
    if name not in SOURCES:
        raise ValueError(f"unknown data source {name!r}; known: {', '.join(SOURCES)}")
    src = SOURCES[name]
    if path is None:
        path = source_path(name)
        if not os.path.exists(path):
            hint = "" if src.shipped else " (not shipped with the repo; pass the path of a copy, see data/SOURCES.md)"
            raise RecordError(f"{path}: no such file for source {name!r}{hint}")
    elif not os.path.exists(path):
        raise RecordError(f"{path}: no such file for source {name!r}")
    records = src.reader(path, name)
    if not records:
        raise RecordError(f"{path}: no records for source {name!r}")
    return records
