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
  LeetCode ``check(Solution().f)``): ``code`` must run without raising. It
  runs in a namespace of trusted text (the imports, LeetCode's helpers, the
  prefix) where the names it takes from the program (the prefix's stubs, and
  names it uses that nothing trusted defines) stand for the program's
  objects. Optional ``"prefix"``: text the program is appended to when it
  does not contain it already (HumanEval's prompt: signature, docstring and
  helper functions); its helpers with a body are the trusted ones.

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
import builtins
import functools
import json
import logging
import math
import os
import re
import symtable
from dataclasses import dataclass, field

from areal_core.reward import code_rpc
from areal_core.reward.sandbox import (
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
TEST_TYPES = ("stdin", "functional", "assert")
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
        if kind == "functional":
            args = [ln for ln in t["input"].split("\n") if ln.strip()]
            for name, texts in (("input", args), ("output", [t["output"]])):
                for text in texts:
                    try:
                        json.loads(text)
                    except ValueError:
                        raise ValueError(f"test {i} (functional): field {name!r} is not JSON: {text[:100]!r}") from None
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
        return CodeResult(False, results[0]["error"][:300], len(tests), 0)
    details, n_ok = [], 0
    for i, (t, r) in enumerate(zip(tests, results)):
        if "error" in r:
            details.append({"test": i, "ok": False, "reason": r["error"][:300]})
            return CodeResult(False, f"test {i}: {r['error'][:300]}", len(tests), n_ok, details)
        if not _close(r["value"], json.loads(t["output"])):
            details.append({"test": i, "ok": False, "reason": "wrong result", "got": str(r["value"])[:200]})
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
        if _check_tests(t) != "functional":
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


def runner_results(stdout: str, n: int) -> list[dict] | None:
    """The last line of a one-at-a-time runner (``code_rpc._one_at_a_time``: the tool episode's calls), checked: one ``{"out", "timed_out", "exit_code", "signal"}`` per job; None otherwise."""
    lines = stdout.strip().splitlines()
    try:
        per = json.loads(lines[-1]) if lines else None
    except (ValueError, RecursionError):
        return None
    keys = {"out", "timed_out", "exit_code", "signal"}
    if type(per) is not list or len(per) != n or any(type(r) is not dict or set(r) != keys for r in per):
        return None
    ok = all(
        isinstance(r["out"], str)
        and isinstance(r["timed_out"], bool)
        and (r["exit_code"] is None or type(r["exit_code"]) is int)
        and (r["signal"] is None or type(r["signal"]) is int)
        for r in per
    )
    return per if ok else None


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


def _is_stub_statement(b: ast.stmt) -> bool:
    if isinstance(b, (ast.Pass, ast.Import, ast.ImportFrom)):
        return True
    return (
        isinstance(b, ast.Expr)
        and isinstance(b.value, ast.Constant)
        and (isinstance(b.value.value, str) or b.value.value is Ellipsis)
    )


def _stub_names(prefix: str) -> list[str]:
    """Top-level functions of the prefix with no body (only a docstring, imports, ``pass`` or ``...``): the
    program's to write. The prefix's other functions are trusted helpers."""
    return [
        node.name
        for node in ast.parse(prefix).body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and all(map(_is_stub_statement, node.body))
    ]


def _grade_assert(program: str, tests: list[dict], limits: SandboxLimits) -> CodeResult:
    prefix = tests[0].get("prefix") or ""
    if prefix and prefix.strip() not in program:
        program = prefix + "\n" + program
    refs, bound = set(), set()
    for i, t in enumerate(tests):
        try:
            r, b = _global_names(t["code"])
        except SyntaxError as e:
            raise ValueError(f"test {i} (assert): code does not parse: {e}") from None
        refs |= r
        bound |= b
    try:
        stubs = _stub_names(prefix)
        prefix_refs, prefix_bound = _global_names(prefix)
        classes = [n.name for n in ast.parse(prefix).body if isinstance(n, ast.ClassDef)]
    except SyntaxError as e:
        raise ValueError(f"test 0 (assert): prefix does not parse: {e}") from None
    job = {
        "prefix": prefix,
        "cases": [t["code"] for t in tests],
        "stubs": stubs,
        # globals the tests look up that they do not define: trusted names, or the program's (the checker sorts)
        "loads": sorted(n for n in refs - bound if not hasattr(builtins, n)),
        # the common imports cost ~6 ms of start-up: only when the tests or the prefix use one of their names
        "imports": bool(((refs - bound) | (prefix_refs - prefix_bound)) & _import_names()),
        "byvalue": sorted({*code_rpc.NODE_CLASS_NAMES, *classes}),
        "max_message": limits.file_size_mb * 2**20,
    }
    run = run_with_checker(
        [sandbox_python(), "-I", "runner.py", "candidate"],
        {"solution.py": PREAMBLE + program, "runner.py": RUNNER_SOURCE},
        {"checker.py": RUNNER_SOURCE, "job.json": json.dumps(job)},
        "checker.py",
        ("checker",),
        limits,
    )
    chk = run.checker
    lines = chk.stdout.splitlines()
    if chk.timed_out or chk.exit_code != 0 or len(lines) != 1:
        if chk.timed_out or chk.signal is not None:
            reason = chk.reason()
        else:
            reason = "the checker failed: " + (chk.stderr.strip().splitlines()[-1:] or ["no verdict"])[0][:300]
        return CodeResult(False, reason, len(tests), 0)
    verdict = json.loads(lines[0])  # written by the trusted checker only
    if "error" in verdict:
        return CodeResult(False, verdict["error"], len(tests), 0)
    details, n_ok = [], 0
    for i, r in enumerate(verdict["results"]):
        if not r["ok"]:
            details.append({"test": i, "ok": False, "reason": r["error"]})
            return CodeResult(False, f"test {i}: {r['error']}", len(tests), n_ok, details)
        details.append({"test": i, "ok": True})
        n_ok += 1
    if n_ok < len(tests):
        return CodeResult(False, "the checker stopped early", len(tests), n_ok, details)
    return CodeResult(True, "ok", len(tests), n_ok, details)


def grade_code(program: str, tests: list[dict], limits: SandboxLimits | None = None) -> CodeResult:
    """Run ``program`` against ``tests`` in the sandbox; passes only if every test passes."""
    kind = _check_tests(tests)
    limits = limits or DEFAULT_LIMITS
    if kind == "stdin":
        return _grade_stdin(program, tests, limits)
    if kind == "functional":
        return _grade_functional(program, tests, limits)
    return _grade_assert(program, tests, limits)
