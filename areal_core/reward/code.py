"""Code grading: run a program against its tests in the sandbox.

Test kinds (dicts, as stored in a record's ``tests``):

* ``{"testtype": "stdin", "input": str, "output": str}``: the program reads
  ``input`` on stdin; its stdout must match ``output`` (line by line after
  stripping trailing whitespace; numbers may differ by 1e-6).
* ``{"testtype": "functional", "input": str, "output": str, "fn_name": str}``
  (LiveCodeBench / LeetCode style): ``input`` holds one JSON value per line,
  the arguments; ``Solution().fn_name(*args)`` (or a top-level ``fn_name``)
  must return the JSON value ``output``.
* ``{"testtype": "assert", "code": str}`` (HumanEval ``check(candidate)``,
  LeetCode ``check(Solution().f)``): ``code`` runs after the program in the
  same namespace and must not raise. Optional ``"prefix"``: text the program
  is appended to when it does not contain it already (HumanEval's prompt:
  signature, docstring and helper functions).

Functional and assert programs get :data:`PREAMBLE` (the imports LeetCode
solutions take for granted). A run passes only if the harness prints a
per-run secret token after the last test, so exiting early with status 0
does not pass.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass, field

from areal_core.reward.sandbox import SandboxLimits, run_python_file

PREAMBLE = (
    "import sys, math, heapq, bisect, itertools, functools, collections, string, re, operator, random\n"
    "from typing import *\n"
    "from collections import *\n"
    "from heapq import *\n"
    "from bisect import *\n"
    "from itertools import *\n"
    "from functools import *\n"
    "from math import *\n"
    "from string import *\n"
    "sys.setrecursionlimit(100000)\n"
)
TEST_TYPES = ("stdin", "functional", "assert")
DEFAULT_LIMITS = SandboxLimits(wall_s=10.0, cpu_s=10)
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

# The harness: runs inside the sandbox. It reads the secret token and the cases
# from stdin before any untrusted code runs, then prints the token followed by
# the JSON results as its last line.
_HARNESS = '''
import json, sys
def _run():
    token = sys.stdin.readline().strip()
    job = json.loads(sys.stdin.readline())
    ns = {"__name__": "solution", "__builtins__": __builtins__}
    src = open("solution.py").read()
    results = []
    try:
        exec(compile(src, "solution.py", "exec"), ns)
    except BaseException as e:
        print(token + json.dumps({"error": "program failed to load: " + repr(e)[:300]}), flush=True)
        return
    if job["kind"] == "assert":
        for i, code in enumerate(job["cases"]):
            try:
                exec(compile(code, "test_%d.py" % i, "exec"), ns)
            except BaseException as e:
                results.append({"ok": False, "error": repr(e)[:300]})
                break
            results.append({"ok": True})
    else:
        name = job["fn_name"]
        target = getattr(ns["Solution"](), name) if "Solution" in ns else ns.get(name)
        if target is None:
            print(token + json.dumps({"error": "no function %r defined" % name}), flush=True)
            return
        for case in job["cases"]:
            try:
                args = [json.loads(line) for line in case.split("\\n") if line.strip()]
                value = target(*args)
                results.append({"ok": True, "value": json.loads(json.dumps(value))})
            except BaseException as e:
                results.append({"ok": False, "error": repr(e)[:300]})
                break
    print(token + json.dumps({"results": results}), flush=True)
_run()
'''


@dataclass
class CodeResult:
    passed: bool
    reason: str
    n_tests: int = 0
    n_passed: int = 0
    details: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.passed


def extract_code(response: str) -> str:
    """The program in a model's response: the last fenced code block (python preferred), else the text."""
    blocks = _FENCE.findall(response)
    if not blocks:
        return response.strip("\n")
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [body for _, body in blocks])[-1]


def _close(a, b) -> bool:
    """Equal JSON values, numbers up to 1e-6 (relative or absolute)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b


def stdout_matches(got: str, want: str) -> bool:
    got_lines = [ln.rstrip() for ln in got.strip().splitlines()]
    want_lines = [ln.rstrip() for ln in want.strip().splitlines()]
    if got_lines == want_lines:
        return True
    got_tok, want_tok = got.split(), want.split()
    if len(got_tok) != len(want_tok):
        return False
    for g, w in zip(got_tok, want_tok):
        if g == w:
            continue
        try:
            if not math.isclose(float(g), float(w), rel_tol=1e-6, abs_tol=1e-6):
                return False
        except ValueError:
            return False
    return True


def _check_tests(tests: list[dict]) -> str:
    if not tests:
        raise ValueError("grade_code needs at least one test")
    kinds = {t.get("testtype") for t in tests}
    if not kinds <= set(TEST_TYPES):
        raise ValueError(f"unknown test type(s) {sorted(map(str, kinds - set(TEST_TYPES)))}; known: {TEST_TYPES}")
    if len(kinds) != 1:
        raise ValueError(f"tests of one problem must share one testtype, got {sorted(kinds)}")
    kind = kinds.pop()
    need = {"stdin": ("input", "output"), "functional": ("input", "output", "fn_name"), "assert": ("code",)}[kind]
    for i, t in enumerate(tests):
        missing = [k for k in need if not isinstance(t.get(k), str)]
        if missing:
            raise ValueError(f"test {i} ({kind}): missing or non-string field(s) {missing}")
    return kind


def _grade_stdin(program: str, tests: list[dict], limits: SandboxLimits) -> CodeResult:
    details = []
    for i, t in enumerate(tests):
        run = run_python_file("solution.py", {"solution.py": program}, t["input"], limits)
        if not run.ok:
            details.append({"test": i, "ok": False, "reason": run.reason()})
            return CodeResult(False, f"test {i}: {run.reason()}", len(tests), i, details)
        if not stdout_matches(run.stdout, t["output"]):
            details.append({"test": i, "ok": False, "reason": "wrong output", "got": run.stdout[:200]})
            return CodeResult(False, f"test {i}: wrong output", len(tests), i, details)
        details.append({"test": i, "ok": True})
    return CodeResult(True, "ok", len(tests), len(tests), details)


def _grade_in_harness(program: str, tests: list[dict], kind: str, limits: SandboxLimits) -> CodeResult:
    token = secrets.token_hex(16)
    if kind == "assert":
        prefix = tests[0].get("prefix") or ""
        if prefix and prefix.strip() not in program:
            program = prefix + "\n" + program
        job = {"kind": "assert", "cases": [t["code"] for t in tests]}
    else:
        job = {"kind": "functional", "fn_name": tests[0]["fn_name"], "cases": [t["input"] for t in tests]}
    files = {"solution.py": PREAMBLE + program, "harness.py": _HARNESS}
    run = run_python_file("harness.py", files, token + "\n" + json.dumps(job) + "\n", limits)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(token)]
    if not lines:
        reason = run.reason() if not run.ok else "the harness did not finish (the program exited early)"
        return CodeResult(False, reason, len(tests), 0)
    report = json.loads(lines[-1][len(token):])
    if "error" in report:
        return CodeResult(False, report["error"], len(tests), 0)
    details, n_ok = [], 0
    for i, (t, r) in enumerate(zip(tests, report["results"])):
        if not r["ok"]:
            details.append({"test": i, "ok": False, "reason": r["error"]})
            return CodeResult(False, f"test {i}: {r['error']}", len(tests), n_ok, details)
        if kind == "functional" and not _close(r["value"], json.loads(t["output"])):
            details.append({"test": i, "ok": False, "reason": "wrong result", "got": str(r["value"])[:200]})
            return CodeResult(False, f"test {i}: wrong result", len(tests), n_ok, details)
        details.append({"test": i, "ok": True})
        n_ok += 1
    if n_ok < len(tests):
        return CodeResult(False, "the harness stopped early", len(tests), n_ok, details)
    return CodeResult(True, "ok", len(tests), n_ok, details)


def grade_code(program: str, tests: list[dict], limits: SandboxLimits | None = None) -> CodeResult:
    """Run ``program`` against ``tests`` in the sandbox; passes only if every test passes."""
    kind = _check_tests(tests)
    limits = limits or DEFAULT_LIMITS
    if kind == "stdin":
        return _grade_stdin(program, tests, limits)
    return _grade_in_harness(program, tests, kind, limits)
