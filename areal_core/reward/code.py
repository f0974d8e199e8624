"""Code grading: run a program against its tests in the sandbox.

Test kinds (dicts, as stored in a record's ``tests``):

* ``{"testtype": "stdin", "input": str, "output": str}``: the program reads
  ``input`` on stdin; its stdout must match ``output`` (line by line after
  stripping trailing whitespace; integers exactly, a number within 1e-6 of an
  expected decimal: :mod:`areal_core.reward.compare`).
* ``{"testtype": "functional", "input": str, "output": str, "fn_name": str}``
  (LiveCodeBench / LeetCode style): ``input`` holds one JSON value per line,
  the arguments; ``Solution().fn_name(*args)`` (or a top-level ``fn_name``)
  must return the JSON value ``output`` (compared as ``compare.values_equal``).
* ``{"testtype": "assert", "code": str, "entry_point": str}`` (HumanEval
  ``check(candidate)``, LeetCode ``check(Solution().f)``): ``code`` must run
  without raising. It runs in a namespace of trusted text (the imports,
  LeetCode's helpers, the prefix) where ``entry_point`` (HumanEval's function,
  LeetCode's ``Solution``), and nothing else, stands for the program's object.
  Optional ``"prefix"``: text the program is appended to when it does not
  contain it already (HumanEval's prompt: signature, docstring and helper
  functions); its helpers are the trusted ones.

Functional and assert programs get :data:`PREAMBLE` (the imports LeetCode
solutions take for granted, and LeetCode's ``ListNode`` / ``TreeNode``).

No part of the verdict is decided where the program runs:

* stdin tests: the host compares the program's stdout with the expected output;
* functional tests: the program's process gets only the arguments and reports
  the return values as JSON lines; the host parses them strictly and compares
  them with the expected values, which never enter the sandbox;
* assert tests: the test code runs in a separate, trusted checker process
  (:mod:`areal_core.reward.code_rpc`) with its own work folder and user id;
  the program's functions are called over a pipe and only plain data comes
  back, so the test code compares built-in values, and the verdict is the
  checker's. Exiting early, printing anything, patching builtins or
  ``sys.exit`` in the program's process, or writing files cannot pass.
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import os
import re
import symtable
from dataclasses import dataclass, field

from areal_core.data.code_tests import TestCaseError, check_test_case, shared_testtype
from areal_core.reward import code_rpc
from areal_core.reward.compare import stdout_matches, values_equal
from areal_core.reward.result import valid_text
from areal_core.reward.sandbox import (
    CheckedRun,
    SandboxLimits,
    SandboxRun,
    guarantees,
    run_each,
    run_python_file,
    run_with_checker,
    sandbox_python,
)

log = logging.getLogger(__name__)
PREAMBLE = code_rpc.IMPORTS + "sys.setrecursionlimit(100000)\n" + code_rpc.NODE_CLASSES + "\n"
DEFAULT_LIMITS = SandboxLimits(wall_s=10.0, cpu_s=10)
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
# code_rpc.py's text: the trusted runner copied into sandbox runs (the grader's roles, the tool episode's calls)
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_rpc.py")) as _f:
    RUNNER_SOURCE = _f.read()


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


def check_tests(tests: list[dict]) -> str:
    """The tests' one testtype; ValueError naming the test, the field and what was expected (the records'
    own check, ``areal_core.data.code_tests``: tests given here directly get the same)."""
    if not tests:
        raise ValueError("grade_code needs at least one test")
    for i, t in enumerate(tests):
        try:
            check_test_case(t)
        except TestCaseError as e:
            raise ValueError(f"test {i} ({t.get('testtype')}): {e}") from None
    return shared_testtype(tests)


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


def _parse_results(stdout: str, n: int) -> tuple[list[dict], str | None]:
    """The functional runner's result lines, validated: ``({"i": k, "value"|"error": ...} in order, why not)``.

    Anything but one well-formed line per case, in order, stopping at the first
    error, makes the whole stream void: the program's process writes these
    lines, so they are claims to check, never a verdict.
    """
    out = []
    for k, line in enumerate(stdout.splitlines()):
        if k >= n:
            return out, "more result lines than tests"
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            return out, f"malformed result line {k}"
        if type(rec) is not dict:
            return out, f"malformed result line {k}"
        if k == 0 and set(rec) == {"error"} and isinstance(rec["error"], str):
            return [rec], None  # the program failed before any case ran
        ok_keys = set(rec) in ({"i", "value"}, {"i", "error"})
        if not ok_keys or type(rec["i"]) is not int or rec["i"] != k or (out and "error" in out[-1]):
            return out, f"malformed result line {k}"
        if "error" in rec and not isinstance(rec["error"], str):
            return out, f"malformed result line {k}"
        out.append(rec)
    return out, None


def _grade_functional(program: str, tests: list[dict], limits: SandboxLimits) -> CodeResult:
    job = {"fn_name": tests[0]["fn_name"], "cases": [t["input"] for t in tests]}
    files = {"solution.py": PREAMBLE + program, "runner.py": RUNNER_SOURCE}
    run = run_python_file("runner.py", files, json.dumps(job), limits, args=("functional",))
    return _functional_verdict(run, tests)


def _functional_verdict(run: SandboxRun, tests: list[dict]) -> CodeResult:
    """The verdict on a functional run's result lines (``run.stdout``), compared here with the
    expected outputs, which never enter the sandbox."""
    results, bad = _parse_results(run.stdout, len(tests))
    if bad:
        return CodeResult(False, f"invalid results from the program's process: {bad}", len(tests), 0)
    if results and set(results[0]) == {"error"}:
        return CodeResult(False, valid_text(results[0]["error"][:300]), len(tests), 0)
    details, n_ok = [], 0
    for i, (t, r) in enumerate(zip(tests, results)):
        if "error" in r:  # what the program's process claims: its text made valid (JSON can carry lone surrogates)
            error = valid_text(r["error"][:300])
            details.append({"test": i, "ok": False, "reason": error})
            return CodeResult(False, f"test {i}: {error}", len(tests), n_ok, details)
        if not values_equal(r["value"], json.loads(t["output"])):
            details.append({"test": i, "ok": False, "reason": "wrong result", "got": valid_text(str(r["value"])[:200])})
            return CodeResult(False, f"test {i}: wrong result", len(tests), n_ok, details)
        details.append({"test": i, "ok": True})
        n_ok += 1
    if n_ok < len(tests):
        reason = run.reason() if not run.ok else "the program's process stopped before the last test"
        return CodeResult(False, reason, len(tests), n_ok, details)
    return CodeResult(True, "ok", len(tests), n_ok, details)


BATCH_MAX = 128  # programs per batched sandbox run (a launch costs ~0.1 s under load, a program ~5 ms)


def grade_functional_many(
    programs: list[str], tests: list[list[dict]], limits: SandboxLimits | None = None
) -> list[CodeResult]:
    """``grade_code`` for several programs with functional tests (a group's answers), with the same
    verdicts, in one sandbox run per ``BATCH_MAX`` programs where the sandbox has user ids of its
    own (``sandbox.run_each``: each program in a process and under a user id of its own, forked from
    a zygote that never holds another program's source or results, its results on a pipe of its
    own; compared here, as always). Where it cannot (no own user id), or when a batched run fails as
    a whole, each of its programs gets a sandbox run of its own. Each program has ``limits``."""
    limits = limits or DEFAULT_LIMITS
    if len(programs) != len(tests):
        raise ValueError(f"{len(programs)} programs but {len(tests)} test lists")
    for t in tests:
        if check_tests(t) != "functional":
            raise ValueError("grade_functional_many takes functional tests only")
    if len(programs) < 2 or not guarantees()["own_user"]:
        return [_grade_functional(p, t, limits) for p, t in zip(programs, tests)]
    out: list[CodeResult] = []
    for k in range(0, len(programs), BATCH_MAX):
        out += _functional_batch(programs[k : k + BATCH_MAX], tests[k : k + BATCH_MAX], limits)
    return out


def _functional_batch(programs: list[str], tests: list[list[dict]], limits: SandboxLimits) -> list[CodeResult]:
    jobs = [
        json.dumps({"source": PREAMBLE + p, "fn_name": t[0]["fn_name"], "cases": [x["input"] for x in t]}).encode()
        for p, t in zip(programs, tests)
    ]
    runs = run_each(RUNNER_SOURCE, "batch_prepare", "batch_functional", jobs, limits)
    if runs is None:  # the run failed as a whole: one sandbox run per program
        log.info("batched grading of %d programs failed; grading them one by one", len(jobs))
        return [_grade_functional(p, t, limits) for p, t in zip(programs, tests)]
    return [_functional_verdict(run, t) for run, t in zip(runs, tests)]


def _global_names(code: str) -> tuple[set[str], set[str]]:
    """(names ``code`` looks up as globals in any scope, names it binds at module level)."""
    top = symtable.symtable(code, "<test>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    refs, stack = set(), [top]
    while stack:
        table = stack.pop()
        stack.extend(table.get_children())
        for sym in table.get_symbols():
            if sym.is_referenced() and (table is top or sym.is_global()):
                refs.add(sym.get_name())
    return refs, bound


@functools.cache
def _import_names() -> frozenset[str]:
    """The names :data:`code_rpc.IMPORTS` defines (stdlib modules and their star exports)."""
    ns: dict = {}
    exec(code_rpc.IMPORTS, ns)
    return frozenset(ns) - {"__builtins__"}


def _assert_job(prefix: str, tests: list[dict], limits: SandboxLimits) -> dict:
    """The checker's job (``code_rpc.checker_main``): the test code, the prefix, the entry points (the only names
    taken from the program), the classes that travel by value."""
    refs, bound = set(), set()
    for text in (prefix, *(t["code"] for t in tests)):
        r, b = _global_names(text)  # (parsed already: check_test_case)
        refs |= r
        bound |= b
    return {
        "prefix": prefix,
        "cases": [t["code"] for t in tests],
        "entry_points": sorted({t["entry_point"] for t in tests}),
        # the common imports cost ~6 ms of start-up: only when the tests or the prefix use one of their names
        "imports": bool((refs - bound) & _import_names()),
        "byvalue": sorted(
            {*code_rpc.NODE_CLASS_NAMES, *(n.name for n in ast.parse(prefix).body if isinstance(n, ast.ClassDef))}
        ),
        "max_message": limits.file_size_mb * 2**20,
    }


def _grade_assert(program: str, tests: list[dict], limits: SandboxLimits) -> CodeResult:
    prefix = tests[0].get("prefix") or ""
    if prefix and prefix.strip() not in program:
        program = prefix + "\n" + program
    run = run_with_checker(
        [sandbox_python(), "-I", "runner.py", "candidate"],
        {"solution.py": PREAMBLE + program, "runner.py": RUNNER_SOURCE},
        {"checker.py": RUNNER_SOURCE, "job.json": json.dumps(_assert_job(prefix, tests, limits))},
        "checker.py",
        ("checker",),
        limits,
    )
    return _assert_verdict(run, len(tests))


def _assert_verdict(run: CheckedRun, n: int) -> CodeResult:
    """The verdict the checker wrote (its one stdout line, out of the program's reach)."""
    chk = run.checker
    lines = chk.stdout.splitlines()
    if chk.timed_out or chk.exit_code != 0 or len(lines) != 1:
        if run.program.limit is not None or run.program.setup_error is not None:  # the run was ended for it
            reason = run.program.reason()
        elif chk.timed_out or chk.signal is not None:
            reason = chk.reason()
        else:
            reason = "the checker failed: " + (chk.stderr.strip().splitlines()[-1:] or ["no verdict"])[0][:300]
        return CodeResult(False, reason, n, 0)
    verdict = json.loads(lines[0])  # written by the trusted checker only
    if "error" in verdict:
        return CodeResult(False, verdict["error"], n, 0)
    details, n_ok = [], 0
    for i, r in enumerate(verdict["results"]):
        if not r["ok"]:
            details.append({"test": i, "ok": False, "reason": r["error"]})
            return CodeResult(False, f"test {i}: {r['error']}", n, n_ok, details)
        details.append({"test": i, "ok": True})
        n_ok += 1
    if n_ok < n:
        return CodeResult(False, "the checker stopped early", n, n_ok, details)
    return CodeResult(True, "ok", n, n_ok, details)


def grade_code(program: str, tests: list[dict], limits: SandboxLimits | None = None) -> CodeResult:
    """Run ``program`` against ``tests`` in the sandbox; passes only if every test passes."""
    kind = check_tests(tests)
    limits = limits or DEFAULT_LIMITS
    if kind == "stdin":
        return _grade_stdin(program, tests, limits)
    if kind == "functional":
        return _grade_functional(program, tests, limits)
    return _grade_assert(program, tests, limits)
