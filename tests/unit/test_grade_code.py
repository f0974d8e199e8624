"""The code grader: stdin, functional and assert tests, answer extraction, and real benchmark data."""

import collections
import json
import math
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from areal_core.data.sources import read_source
from areal_core.reward import extract_code, grade_code
from areal_core.reward.code import stdout_matches
from areal_core.reward.dispatch import grade
from areal_core.reward.sandbox import SandboxLimits

SUM_TESTS = [
    {"testtype": "stdin", "input": "1 2\n", "output": "3\n"},
    {"testtype": "stdin", "input": "10 -4\n", "output": "6\n"},
]
FAST = SandboxLimits(wall_s=5.0, cpu_s=5)


def test_stdin_program_right_and_wrong():
    assert grade_code("a, b = map(int, input().split())\nprint(a + b)\n", SUM_TESTS, FAST).passed
    wrong = grade_code("a, b = map(int, input().split())\nprint(a - b)\n", SUM_TESTS, FAST)
    assert not wrong.passed and wrong.reason == "test 0: wrong output"
    # right on the first test only: the second decides
    half = grade_code("a, b = map(int, input().split())\nprint(3 if a == 1 else 0)\n", SUM_TESTS, FAST)
    assert not half.passed and half.n_passed == 1 and half.reason.startswith("test 1")


def test_stdin_crash_reports_the_error():
    r = grade_code("raise SystemExit('boom')\n", SUM_TESTS, FAST)
    assert not r.passed and "exit code 1" in r.reason


def test_output_comparison():
    assert stdout_matches("3 \n\n", "3")
    assert stdout_matches("0.33333334", "0.33333333")  # the expected form, within the relative tolerance
    assert not stdout_matches("0.3333333", "0.33333333")  # another form: as the problem states it
    # integers exactly (a relative tolerance would take 10**20 + 1 for 10**20), and as the text they are
    assert not stdout_matches("100000000000000000001", "100000000000000000000")
    assert not stdout_matches("49.0", "49") and not stdout_matches("049", "49")
    assert not stdout_matches("0.34", "0.33")
    assert not stdout_matches("1 2", "1 2 3")
    assert not stdout_matches("yes", "no")


def test_a_tolerance_only_where_the_answer_is_a_float_and_formats_as_stated():
    """What graded wrong answers right before: zero for a tiny expected float (an absolute floor took it),
    an integer without its zero padding, a decimal without its stated digits. Each right answer passes."""
    tiny = [{"testtype": "functional", "input": "3", "output": "1e-09", "fn_name": "f"}]
    assert not grade_code("def f(n):\n    return 0\n", tiny, FAST).passed
    assert grade_code("def f(n):\n    return 1e-09\n", tiny, FAST).passed
    padded = [{"testtype": "stdin", "input": "5\n", "output": "00000101\n"}]
    assert not grade_code("print(bin(int(input()))[2:])\n", padded, FAST).passed
    assert grade_code("print(format(int(input()), '08b'))\n", padded, FAST).passed
    money = [{"testtype": "stdin", "input": "5 2\n", "output": "2.50\n"}]
    assert not grade_code("a, b = map(int, input().split())\nprint(a / b)\n", money, FAST).passed
    assert grade_code("a, b = map(int, input().split())\nprint(f'{a / b:.2f}')\n", money, FAST).passed


def test_functional_tests_leetcode_style():
    tests = [
        {"testtype": "functional", "input": "[1, 2, 3]\n2", "output": "[2, 4, 6]", "fn_name": "scale"},
        {"testtype": "functional", "input": "[]\n5", "output": "[]", "fn_name": "scale"},
    ]
    good = "class Solution:\n    def scale(self, xs: List[int], k: int) -> List[int]:\n        return [x * k for x in xs]\n"
    bad = "class Solution:\n    def scale(self, xs, k):\n        return [x + k for x in xs]\n"
    assert grade_code(good, tests, FAST).passed
    r = grade_code(bad, tests, FAST)
    assert not r.passed and r.reason == "test 0: wrong result"
    assert grade_code("def scale(xs, k):\n    return [x * k for x in xs]\n", tests, FAST).passed  # top-level function
    missing = grade_code("class Solution:\n    pass\n", tests, FAST)
    assert not missing.passed and "AttributeError" in missing.reason


def test_assert_tests_and_early_exit_does_not_pass():
    tests = [
        {
            "testtype": "assert",
            "code": "def check(f):\n    assert f(2) == 4\n\ncheck(square)\n",
            "entry_point": "square",
        }
    ]
    assert grade_code("def square(x):\n    return x * x\n", tests, FAST).passed
    assert not grade_code("def square(x):\n    return x + x + 1\n", tests, FAST).passed
    # exiting with status 0 before the checks run is not a pass
    assert not grade_code("import sys\nsys.exit(0)\n", tests, FAST).passed
    assert not grade_code("import os\nos._exit(0)\n", tests, FAST).passed


def test_bad_tests_are_rejected():
    with pytest.raises(ValueError):
        grade_code("print(1)", [])
    with pytest.raises(ValueError):
        grade_code("print(1)", [{"testtype": "nope", "input": "", "output": ""}])
    with pytest.raises(ValueError):
        grade_code("print(1)", [{"testtype": "functional", "input": "1", "output": "1"}])  # no fn_name
    with pytest.raises(ValueError, match=r"test 1 \(functional\): field 'output': expected JSON, got '\[1,'"):
        grade_code(
            "print(1)",
            [
                {"testtype": "functional", "input": "1", "output": "1", "fn_name": "f"},
                {"testtype": "functional", "input": "1", "output": "[1,", "fn_name": "f"},
            ],
        )
    with pytest.raises(ValueError, match=r"test 0 \(functional\): field 'input': expected JSON, got 'abc'"):
        grade_code("print(1)", [{"testtype": "functional", "input": "[1]\nabc", "output": "1", "fn_name": "f"}])
    # an assert test names the one thing it takes from the program
    with pytest.raises(ValueError, match=r"test 0 \(assert\): field 'entry_point': expected the name .* got missing"):
        grade_code("def f():\n    return 1\n", [{"testtype": "assert", "code": "assert f() == 1\n"}])
    with pytest.raises(ValueError, match=r"field 'entry_point': expected a Python name, got 'f\(\)'"):
        grade_code(
            "def f():\n    return 1\n", [{"testtype": "assert", "code": "assert f() == 1", "entry_point": "f()"}]
        )


def test_extract_code_takes_the_last_python_block():
    text = "Idea:\n```\nnot this\n```\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```\nDone."
    assert extract_code(text).strip() == "print(2)"
    assert extract_code("print(3)\n").strip() == "print(3)"


def test_dispatch_routes_code():
    r = grade("code", "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```", "", SUM_TESTS)
    assert r.correct and "print(a + b)" in r.parsed
    with pytest.raises(ValueError):
        grade("code", "print(1)", "", None)


def _sample(records, n, seed=0):
    return random.Random(seed).sample(records, n)


def test_humaneval_canonical_solutions_sample_pass_and_broken_ones_fail():
    """A sample here (the full 164/164 is the CLI self-check, docs/EVALUATION.md)."""
    recs = _sample(read_source("humaneval"), 12)
    with ThreadPoolExecutor(4) as pool:
        good = list(pool.map(lambda r: grade_code(r.solution, r.tests), recs))
        # the same solutions with every return value replaced must fail their checks
        broken = list(pool.map(lambda r: grade_code(r.solution.replace("return ", "return None and "), r.tests), recs))
    assert [g.passed for g in good] == [True] * len(recs), [(r.id, g.reason) for r, g in zip(recs, good)]
    assert sum(b.passed for b in broken) <= 1  # a check() may accept None/False for one problem


def test_leetcode_reference_solutions_sample_pass():
    recs = [r for r in _sample(read_source("leetcode"), 13, seed=1) if "sortedcontainers" not in r.solution][:12]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda r: grade(r.task, f"```python\n{r.solution}\n```", r.answer, r.tests), recs))
    assert all(res.correct for res in results), [(r.id, res.reason) for r, res in zip(recs, results)]


# ---------------------------------------------------------------------------------------------------------------
# Where the verdict is decided: functional results are parsed strictly on the host; assert tests run in a trusted
# checker process that gets only plain data back from the program (areal_core/reward/code_rpc.py). The hostile
# programs are in tests/e2e/test_sandbox_hostile.py; here: fidelity and the protocol's strictness.

from areal_core.reward import code_rpc  # noqa: E402
from areal_core.reward.code import _parse_results  # noqa: E402


def test_functional_result_stream_is_parsed_strictly():
    ok = '{"i": 0, "value": [1, 2]}\n{"i": 1, "value": null}\n'
    assert _parse_results(ok, 2) == ([{"i": 0, "value": [1, 2]}, {"i": 1, "value": None}], None)
    assert _parse_results('{"i": 0, "error": "ValueError()"}\n', 2) == ([{"i": 0, "error": "ValueError()"}], None)
    assert _parse_results('{"error": "program failed to load: X"}\n', 2)[1] is None
    for bad in (
        ok + '{"i": 2, "value": 1}\n',  # more lines than tests
        '{"i": 1, "value": 1}\n',  # out of order
        '{"i": 0, "value": 1}\n{"i": 0, "value": 1}\n',  # repeated
        '{"i": 0, "value": 1, "ok": true}\n',  # extra key
        '{"i": "0", "value": 1}\n',
        '{"i": 0}\n',
        "[1]\n",
        "ok\n",
        '0123abcd{"results": []}\n',
        '{"i": 0, "error": "E"}\n{"i": 1, "value": 1}\n',  # a result after an error
        "[" * 100000 + "\n",
    ):  # nesting deeper than the parser's recursion
        assert _parse_results(bad, 2)[1] is not None, bad[:60]


def test_functional_non_json_return_value_fails():
    tests = [{"testtype": "functional", "input": "2", "output": "4", "fn_name": "f"}]
    r = grade_code("def f(x):\n    return {x * 2}\n", tests, FAST)
    assert not r.passed and "not JSON serializable" in r.reason
    r = grade_code("x = 1\n", tests, FAST)
    assert not r.passed and "no function 'f' defined" in r.reason


def _round_trip(value, byvalue=()):
    classes = {c.__name__: c for c in byvalue}
    handles = []

    def other(x):
        if type(x) in byvalue:
            return enc.obj(x)
        handles.append(x)
        return {"handle": len(handles) - 1}

    enc = code_rpc.Encoder(other)
    wire = json.loads(json.dumps(enc.message(value), allow_nan=False))  # what travels
    return code_rpc.Decoder(lambda name: object.__new__(classes[name]), lambda n: ("handle", n)).message(wire)


class _Node:
    def __init__(self, val=0, next=None):
        self.val, self.next = val, next


def test_wire_values_keep_their_exact_types():
    value = [
        None,
        True,
        3,
        -(2**20000),
        2.5,
        float("inf"),
        float("-inf"),
        "é\ud800",
        b"\x00\xff",
        1 + 2j,
        (1, (2,)),
        {1: "a", (2, 3): [4]},
        {1, 2},
        frozenset({3}),
        [],
        {},
    ]
    back = _round_trip(value)
    assert back == value and [type(v) for v in back] == [type(v) for v in value]
    assert math.isnan(_round_trip(float("nan")))
    # subclasses are not sent as themselves: the other side's handler decides (here: a handle)
    assert _round_trip(collections.OrderedDict(a=1)) == ("handle", 0)


def test_wire_objects_by_value_keep_sharing_and_cycles():
    a = _Node(1)
    a.next = _Node(2, a)
    back = _round_trip([a, a], byvalue=(_Node,))
    assert back[0] is back[1] and back[0].next.next is back[0] and back[0].next.val == 2
    long = None
    for i in range(20000):  # a long linked list is encoded without recursion
        long = _Node(i, long)
    back = _round_trip(long, byvalue=(_Node,))
    n = 0
    while back is not None:
        back, n = back.next, n + 1
    assert n == 20000


@pytest.mark.parametrize(
    "wire",
    [
        {"v": {"nope": 1}},
        {"v": {"tuple": 1}},
        {"v": {"dict": [[1]]}},
        {"v": {"dict": [[[1], 2]]}},
        {"v": {"set": [[1]]}},
        {"v": {"float": "1.5"}},
        {"v": {"int": "xyz"}},
        {"v": {"bytes": "zz"}},
        {"v": {"complex": ["a", 1]}},
        {"v": {"obj": 0}},
        {"v": {"obj": -1}},
        {"v": {"handle": "0"}},
        {"v": {"tuple": [], "set": []}},
        {"v": [[[[1]]]] * 1, "objs": [["_Node"]]},
        {"v": {"obj": 0}, "objs": [["Unknown", {}]]},  # not a class this side trusts
        {"v": {"obj": 0}, "objs": [["_Node", {"__class__": 1}]]},  # dunder attribute
        {"v": {"obj": 0}, "objs": [["_Node", {"val": {"handle": 0}}]]},  # a handle inside an object
    ],
)
def test_wire_rejects_malformed_values(wire):
    def make(name):
        if name != "_Node":
            raise code_rpc.ProtocolError(name)
        return object.__new__(_Node)

    with pytest.raises(code_rpc.ProtocolError):
        code_rpc.Decoder(make, lambda n: n).message(wire)


def test_wire_rejects_deep_nesting():
    wire = {"v": json.loads("[" * (code_rpc.MAX_DEPTH + 5) + "]" * (code_rpc.MAX_DEPTH + 5))}
    with pytest.raises(code_rpc.ProtocolError):
        code_rpc.Decoder(None, None).message(wire)


def _assert_test(code, entry, prefix=None):
    t = {"testtype": "assert", "code": code, "entry_point": entry}
    if prefix is not None:
        t["prefix"] = prefix
    return [t]


def test_assert_tests_compare_exact_types_and_see_exceptions():
    types = _assert_test(
        "def check(c):\n    assert c() == ((1, 2), {3: [4.5, None]}, {1}, b'x', 2**5000, float('inf'))\n"
        "    assert type(c()[0]) is tuple\n\ncheck(f)\n",
        "f",
    )
    assert grade_code(
        "def f():\n    return ((1, 2), {3: [4.5, None]}, {1}, b'x', 2**5000, float('inf'))\n", types, FAST
    ).passed
    assert not grade_code(
        "def f():\n    return ([1, 2], {3: [4.5, None]}, {1}, b'x', 2**5000, float('inf'))\n", types, FAST
    ).passed
    raises = _assert_test(
        "def check(c):\n    try:\n        c(-1)\n    except ValueError:\n        return\n    assert False\n\ncheck(f)\n",
        "f",
    )
    assert grade_code("def f(x):\n    raise ValueError('negative')\n", raises, FAST).passed
    assert not grade_code("def f(x):\n    return 0\n", raises, FAST).passed
    # the program's exception is seen as its nearest built-in class, as `except` would see it
    assert grade_code("class E(ValueError):\n    pass\ndef f(x):\n    raise E()\n", raises, FAST).passed
    r = grade_code("def f(x):\n    raise type('ValueError', (Exception,), {})()\n", raises, FAST)
    assert not r.passed and "Exception('')" in r.reason
    # a BaseException that is not an Exception (SystemExit, KeyboardInterrupt) is an ordinary failure in the
    # checker: it cannot end the checker
    for exc in ("SystemExit(0)", "KeyboardInterrupt()", "GeneratorExit()"):
        r = grade_code(f"def f(x):\n    raise {exc}\n", raises, FAST)
        assert not r.passed and "CandidateError" in r.reason, (exc, r.reason)


def test_control_flow_exceptions_of_the_program_are_candidate_errors():
    """A StopIteration out of the program's function would end the test's map() early: all(map(...)) of
    nothing is true. It reaches the test code as a CandidateError, which nothing catches."""
    tests = _assert_test(
        "def check(c):\n    assert all(map(lambda x: c(x) == x * x, [2, 3, 7]))\n    assert list(zip(map(c, [1]), [1])) == [(1, 1)]\n\ncheck(square)\n",
        "square",
    )
    assert grade_code("def square(x):\n    return x * x\n", tests, FAST).passed
    for exc in ("StopIteration", "StopAsyncIteration", "type('S', (StopIteration,), {})"):
        r = grade_code(f"def square(x):\n    raise {exc}()\n", tests, FAST)
        assert not r.passed and "CandidateError" in r.reason, (exc, r.reason)
    # the live attack: in the test's own interpreter the same program passes this test
    ns: dict = {}
    exec("def square(x):\n    raise StopIteration\n", ns)
    exec(tests[0]["code"].replace("check(square)", "") + "\nresult = all(map(lambda x: square(x) == x * x, [2]))", ns)
    assert ns["result"] is True


def test_assert_objects_of_the_program_are_handles():
    tests = _assert_test(
        "def check(c):\n    s = c()\n    assert s.total(2) == 5 and s.base == 3\n\ncheck(Counter3)\n", "Counter3"
    )
    prog = "class Counter3:\n    base = 3\n    def total(self, x):\n        return self.base + x\n"
    assert grade_code(prog, tests, FAST).passed
    assert not grade_code(prog.replace("self.base + x", "self.base - x"), tests, FAST).passed


def test_assert_trusted_names_win_over_the_programs():
    # an entry point named like an import (math.gcd): the prefix's stub says it is the program's
    prefix = 'def gcd(a, b):\n    """Greatest common divisor."""\n'
    tests = _assert_test(
        "import math\n\ndef check(candidate):\n    assert candidate(12, 18) == math.gcd(12, 18)\n\ncheck(gcd)\n",
        "gcd",
        prefix,
    )
    assert grade_code("def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n", tests, FAST).passed
    assert not grade_code("def gcd(a, b):\n    return 1\n", tests, FAST).passed
    # a helper with a body in the prefix is trusted: the program's redefinition is not what the tests call
    prefix = (
        "class Box:\n    def __init__(self, v):\n        self.v = v\n    def ok(self):\n        return self.v == 49\n"
        '\n\ndef square_box(x):\n    """A Box of x squared."""\n'
    )
    tests = _assert_test("def check(c):\n    assert c(7).ok()\n\n\ncheck(square_box)\n", "square_box", prefix)
    assert grade_code("def square_box(x):\n    return Box(x * x)\n", tests, FAST).passed
    for forged in (
        "def square_box(x):\n    b = Box(0)\n    b.ok = lambda: True\n    return b\n",  # shadow the method
        "def square_box(x):\n    b = Box(0)\n    b.ok = True\n    return b\n",
        (
            "class Box:\n    def __init__(self, v):\n        self.v = v\n    def ok(self):\n        return True\n"
            "def square_box(x):\n    return Box(0)\n"
        ),
    ):  # redefine the class
        assert not grade_code(forged, tests, FAST).passed, forged
    # top-level asserts (MBPP style), no prefix: the entry point is the program's
    assert grade_code("def add(a, b):\n    return a + b\n", _assert_test("assert add(1, 2) == 3\n", "add"), FAST).passed


def test_assert_leetcode_node_helpers():
    tests = _assert_test(
        "def check(candidate):\n    assert is_same_list(candidate(head=list_node([1, 2, 3])), "
        "list_node([3, 2, 1]))\n    assert candidate(head=None) is None\n    n = 3000\n"
        "    assert is_same_list(candidate(head=list_node(list(range(n)))), list_node(list(range(n))[::-1]))"
        "\n\n\ncheck(Solution().reverseList)\n",
        "Solution",
    )
    prog = (
        "class Solution:\n    def reverseList(self, head: Optional[ListNode]) -> Optional[ListNode]:\n"
        "        prev = None\n        while head:\n            head.next, prev, head = prev, head, head.next\n"
        "        return prev\n"
    )
    assert grade_code(prog, tests, FAST).passed
    assert not grade_code(prog.replace("return prev", "return head"), tests, FAST).passed
    trees = _assert_test(
        "def check(candidate):\n    assert is_same_tree(candidate(root=tree_node([4, 2, 7, 1, 3])), "
        "tree_node([4, 7, 2, None, None, 3, 1]))\n\n\ncheck(Solution().invertTree)\n",
        "Solution",
    )
    inv = (
        "class Solution:\n    def invertTree(self, root):\n        if root:\n"
        "            root.left, root.right = self.invertTree(root.right), self.invertTree(root.left)\n"
        "        return root\n"
    )
    assert grade_code(inv, trees, FAST).passed
    assert not grade_code(inv.replace("root.left, root.right =", "root.right, root.left ="), trees, FAST).passed


def test_only_the_entry_point_is_taken_from_the_program():
    """A name the test code uses that nothing trusted defines is not looked up in the program: the program
    cannot supply the test's helpers (here ``poly``, which a forged pass would define to agree with anything)."""
    code = "def check(c):\n    x = c(3)\n    assert poly(x) == 0\n\ncheck(find_zero)\n"
    prog = "def poly(x):\n    return 0\ndef find_zero(x):\n    return 1\n"
    r = grade_code(prog, _assert_test(code, "find_zero"), FAST)
    assert not r.passed and "NameError" in r.reason and "poly" in r.reason, r
    # with poly trusted (the prefix's), the same program is checked against it
    prefix = "def poly(x):\n    return x - 1\n\n\ndef find_zero(x):\n    ...\n"
    assert grade_code(prog, _assert_test(code, "find_zero", prefix), FAST).passed
    assert not grade_code(prog.replace("return 1", "return 2"), _assert_test(code, "find_zero", prefix), FAST).passed
    # a program without the entry point: the test fails on a NameError, whatever else it defines
    r = grade_code("def other(x):\n    return 1\n", _assert_test(code, "find_zero"), FAST)
    assert not r.passed and "NameError" in r.reason and "find_zero" in r.reason, r


def test_assert_test_code_that_does_not_parse_is_a_clear_error():
    with pytest.raises(ValueError, match=r"test 1 \(assert\): field 'code': Python that does not parse"):
        grade_code(
            "def f():\n    return 1\n", _assert_test("assert f() == 1\n", "f") + _assert_test("assert (\n", "f"), FAST
        )
