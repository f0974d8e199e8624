"""The unit tests a code record carries: their formats, checked when a record is built or read.

The formats are the code grader's (``areal_core.reward.code``), the same in training and
in evaluation:

* ``{"testtype": "stdin", "input": str, "output": str}``
* ``{"testtype": "functional", "input": str, "output": str, "fn_name": str}``: ``input``
  holds one JSON value per line (the arguments), ``output`` one JSON value;
* ``{"testtype": "assert", "code": str, "entry_point": str}`` with an optional ``"prefix": str``:
  Python that must run without raising (it must parse); ``entry_point`` is the one name it takes
  from the program (HumanEval's function, LeetCode's ``Solution``): everything else it uses is
  trusted (the grader's imports and helpers, the prefix), never the program's.

All tests of one problem share one ``testtype``. A malformed test is refused here, when the
data is loaded, rather than when its first answer is graded in the middle of a run.
"""

from __future__ import annotations

import ast
import json

TEST_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # testtype -> (required, optional)
    "stdin": (("input", "output"), ()),
    "functional": (("input", "output", "fn_name"), ()),
    "assert": (("code", "entry_point"), ("prefix",)),
}
TEST_TYPES = tuple(TEST_FIELDS)


class TestCaseError(ValueError):
    """A malformed test case: ``field`` is the one that is wrong (None: the case as a whole)."""

    def __init__(self, field: str | None, reason: str):
        super().__init__(reason if field is None else f"field {field!r}: {reason}")
        self.field, self.reason = field, reason


def _show(value) -> str:
    return "missing" if value is None else f"{type(value).__name__} {str(value)[:60]!r}"


def _json_values(text: str, field: str) -> None:
    lines = [ln for ln in text.split("\n") if ln.strip()] if field == "input" else [text]
    if field == "input" and not lines:
        raise TestCaseError("input", "expected one JSON value per line (the arguments), got none")
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            raise TestCaseError(field, f"expected JSON, got {line[:60]!r}") from None


def _parses(text: str, field: str) -> None:
    try:
        ast.parse(text)
    except SyntaxError as e:
        raise TestCaseError(field, f"Python that does not parse (line {e.lineno}: {e.msg})") from None


def _python_name(text: str, field: str) -> None:
    if not text.isidentifier():
        raise TestCaseError(field, f"expected a Python name, got {text[:60]!r}")


def check_test_case(test: dict) -> dict:
    """One test case, checked against its ``testtype``'s format (returned unchanged).

    Raises :class:`TestCaseError` naming the field that is wrong."""
    kind = test.get("testtype")
    if kind not in TEST_FIELDS:
        raise TestCaseError("testtype", f"expected one of {', '.join(TEST_TYPES)}, got {_show(kind)}")
    required, optional = TEST_FIELDS[kind]
    unknown = sorted(set(test) - {"testtype", *required, *optional})
    if unknown:
        raise TestCaseError(
            None,
            f"unknown field(s) {unknown} for a {kind} test (its fields: testtype, {', '.join(required + optional)})",
        )
    # an assert test's entry point is checked last, after the code and prefix it names something of
    texts = [k for k in required if k != "entry_point"] + [k for k in optional if k in test]
    for name in texts:
        if not isinstance(test.get(name), str):
            raise TestCaseError(name, f"expected a string, got {_show(test.get(name))}")
    if kind == "functional":
        _python_name(test["fn_name"], "fn_name")
        _json_values(test["input"], "input")
        _json_values(test["output"], "output")
    elif kind == "assert":
        _parses(test["code"], "code")
        if "prefix" in test:
            _parses(test["prefix"], "prefix")
        if not isinstance(test.get("entry_point"), str):
            raise TestCaseError(
                "entry_point",
                "expected the name the test code takes from the program (HumanEval's function, LeetCode's Solution), "
                f"got {_show(test.get('entry_point'))}",
            )
        _python_name(test["entry_point"], "entry_point")
    return test


def shared_testtype(tests: list[dict]) -> str:
    """The one testtype of a problem's tests (each already checked); ValueError if none or several."""
    if not tests:
        raise ValueError("a code problem needs at least one test")
    kinds = sorted({t["testtype"] for t in tests})
    if len(kinds) > 1:
        raise ValueError(f"the tests of one problem must share one testtype, got {kinds}")
    return kinds[0]
