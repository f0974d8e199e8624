"""The grader's comparisons (areal_core/reward/compare.py) against independent reference computations (exact
rational arithmetic), the seccomp filter's program against a reference BPF interpreter, the process-tree
accounting against psutil, assert tests' entry points refused at load when missing, and verdict text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from decimal import Decimal
from fractions import Fraction

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_core.reward import sandbox_seccomp, sandbox_tree
from areal_core.reward.compare import stdout_matches, values_equal
from areal_core.reward.result import RewardResult

TOL = Fraction(1, 10**6)


def _ref_float_close(got, want: float) -> bool:
    """|got - want| <= 1e-6 * max(|got|, |want|), in exact rationals (relative only: no absolute floor)."""
    g, w = Fraction(got), Fraction(want)
    return abs(g - w) <= TOL * max(abs(g), abs(w))


def test_integers_are_compared_exactly_at_any_size():
    for n in (0, 1, 49, 10**20, 2**1023, 10**400, -(10**4000)):
        assert values_equal(n, n) and not values_equal(n + 1, n) and not values_equal(n, n + 1)
    assert not values_equal(10**400, 49) and not values_equal(49, 10**400)  # no OverflowError either way
    assert not values_equal(10**20 + 1, 10**20)  # math.isclose(rel 1e-6) calls these equal
    assert values_equal(49.0, 49) and not values_equal(49.0000001, 49)  # a float exactly equal to an int is equal
    assert not values_equal(float("inf"), 10**400) and not values_equal(10**400, 1.5)


def test_booleans_strings_and_null_are_not_numbers():
    assert not values_equal(True, 1) and not values_equal(1, True) and not values_equal(0, False)
    assert values_equal(True, True) and not values_equal(True, False)
    assert not values_equal("49", 49) and not values_equal(None, 0) and values_equal(None, None)


@settings(max_examples=300, deadline=None)
@given(
    want=st.floats(min_value=-1e12, max_value=1e12, allow_nan=False),
    k=st.one_of(st.floats(min_value=0, max_value=0.9), st.floats(min_value=1.1, max_value=50)),
    sign=st.sampled_from([-1, 1]),
)
def test_floats_within_the_tolerance_as_exact_arithmetic_says(want, k, sign):
    """Points away from the tolerance's edge (k times it, k <= 0.9 or >= 1.1): the verdict is the exact one."""
    bound = 1e-6 * abs(want)
    got = want + sign * k * bound
    assert values_equal(got, want) == _ref_float_close(got, want), (got, want)


def test_non_finite_and_huge_against_floats():
    assert not values_equal(float("nan"), float("nan")) and not values_equal(float("nan"), 1.0)
    assert values_equal(float("inf"), float("inf")) and not values_equal(float("inf"), 1e308)
    assert not values_equal(2**1024 - 1, 1.7976931348623157e308)  # rounds to inf as a float: far from any float


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda c: st.lists(c) | st.dictionaries(st.text(max_size=3), c),
        max_leaves=20,
    )
)
def test_structures_equal_themselves_and_differ_when_a_leaf_does(value):
    assert values_equal(value, json.loads(json.dumps(value)))
    assert not values_equal([value, 1], [value, 2]) and not values_equal({"k": value}, {"j": value})


def test_deep_nesting_is_walked_without_recursion():
    a = b = 0
    for _ in range(200_000):
        a, b = [a], [b]
    assert values_equal(a, b)


def _ref_token_equal(got: str, want: str) -> bool:
    """The reference for one output token: an integer token as text; a decimal token of the same form (digits
    after the point, an exponent or not) as exact rationals within the relative tolerance; anything else as text."""
    import re

    num = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
    if got == want:
        return True
    if re.fullmatch(r"[+-]?\d+", want) or not (num.fullmatch(want) and num.fullmatch(got)):
        return False

    def form(t: str) -> tuple[int, bool]:
        m = num.fullmatch(t)
        point = m.group(1).split(".")
        return (len(point[1]) if len(point) > 1 else 0), m.group(2) is not None

    return form(got) == form(want) and _ref_float_close(Fraction(Decimal(got)), Fraction(Decimal(want)))


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.integers(-(10**30), 10**30).map(str),
        st.decimals(allow_nan=False, allow_infinity=False, places=8).map(str),
        st.sampled_from(["nan", "inf", "-0", "1_000", "0x10", "+7", "007", "1e400", "49.0", "yes"]),
    ),
    st.one_of(
        st.integers(-(10**30), 10**30).map(str),
        st.decimals(allow_nan=False, allow_infinity=False, places=8).map(str),
        st.sampled_from(["7", "49", "0", "0.5", "1e400", "1000", "inf"]),
    ),
)
def test_output_tokens_as_the_reference_says(got, want):
    assert stdout_matches(got, want) == _ref_token_equal(got, want), (got, want)


def test_output_tokens_exactly():
    assert not stdout_matches("100000000000000000001", "100000000000000000000")
    assert stdout_matches("1" * 5000, "1" * 5000) and not stdout_matches("1" * 5000 + "1", "1" * 5001 + "0")
    assert not stdout_matches("-0", "0") and not stdout_matches("49.0", "49") and not stdout_matches("1_000", "1000")
    # an integer token is text: zero padding and signs are part of the answer
    assert not stdout_matches("101", "00000101") and not stdout_matches("+7", "7") and stdout_matches("007", "007")
    # a decimal token in the expected form, within the relative tolerance; another form is another answer
    assert not stdout_matches("2.5", "2.50") and stdout_matches("2.50", "2.50")
    assert stdout_matches("0.3333334", "0.3333333") and not stdout_matches("0.333333", "0.3333333")
    assert stdout_matches("1.0000001e5000", "1.0000000e5000") and not stdout_matches("1.0000001e500000", "1e500000")
    assert not stdout_matches("1e99999999999999999999", "1.0")  # an exponent past any context: not a number here


# ---------------------------------------------------------------------------------------------------------------
# The seccomp filter, run by a reference interpreter of classic BPF (only what a seccomp filter may use).


def _run_bpf(prog, nr: int, arch: int, arg0: int = 0) -> int:
    data = {0: nr, 4: arch, 16: arg0 & 0xFFFFFFFF, 20: arg0 >> 32}
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = prog[pc]
        if code == sandbox_seccomp.LD_W_ABS:
            acc = data[k]
            pc += 1
        elif code == sandbox_seccomp.RET_K:
            return k
        else:
            cond = {
                sandbox_seccomp.JEQ_K: acc == k,
                sandbox_seccomp.JGE_K: acc >= k,
                sandbox_seccomp.JSET_K: acc & k != 0,
            }[code]
            pc += 1 + (jt if cond else jf)


@pytest.mark.parametrize("machine", sorted(sandbox_seccomp.ARCHES))
def test_the_filter_refuses_what_it_lists_and_allows_the_rest(machine):
    arch, nr = sandbox_seccomp.ARCHES[machine]
    prog = sandbox_seccomp.program(machine)
    eperm, allow = sandbox_seccomp.RET_ERRNO | 1, sandbox_seccomp.RET_ALLOW
    for name in sandbox_seccomp.DENIED:
        assert _run_bpf(prog, nr[name], arch) == eperm, name
    assert _run_bpf(prog, nr["clone3"], arch) == sandbox_seccomp.RET_ERRNO | 38  # ENOSYS: the C library falls back
    assert _run_bpf(prog, nr["clone"], arch, 0x01200011) == allow  # fork's flags (CLONE_CHILD_SETTID|CLEARTID|SIGCHLD)
    assert _run_bpf(prog, nr["clone"], arch, 0x003D0F00) == allow  # a thread's
    for flag in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000):
        assert _run_bpf(prog, nr["clone"], arch, 0x11 | flag) == eperm, hex(flag)
    denied = {nr[n] for n in (*sandbox_seccomp.DENIED, "clone", "clone3")}
    for other in sorted(set(range(460)) - denied):  # read, write, mmap, fork, execve, ...
        assert _run_bpf(prog, other, arch) == allow, other
    assert _run_bpf(prog, 39, 0x40000003) == sandbox_seccomp.RET_KILL_PROCESS  # another architecture's numbering
    if machine == "x86_64":
        assert _run_bpf(prog, 0x40000000 | 39, arch) == eperm  # the x32 numbering


# ---------------------------------------------------------------------------------------------------------------
# The accounting of an answer's processes, against psutil.


def test_descendants_and_their_memory_as_psutil_sees_them():
    prog = (
        "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        b = bytearray(30 * 2**20)\n"
        "        b[::4096] = b'x' * len(b[::4096])\n        if os.fork() == 0:\n            time.sleep(30)\n"
        "        time.sleep(30)\ntime.sleep(30)\n"
    )
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", prog], start_new_session=True)
    try:
        ref = psutil.Process(proc.pid)
        deadline = time.monotonic() + 30
        while len(ref.children(recursive=True)) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        kids = {p.pid for p in ref.children(recursive=True)}
        assert set(sandbox_tree.descendant_pids(proc.pid)) == kids and len(kids) == 6
        pids = [proc.pid, *kids]
        tasks, pss = sandbox_tree.usage(pids, 0)  # past a limit of 0: the proportional sizes
        want = sum(psutil.Process(p).memory_full_info().pss for p in pids)
        assert tasks == 7 and abs(pss - want) <= 0.02 * want, (pss, want)
        assert pss > 3 * 30 * 2**20  # the three bytearrays, each counted once
        rss_tasks, rss = sandbox_tree.usage(pids, 10**15)  # under the limit: the resident sizes, at least as large
        assert rss_tasks == 7 and rss >= pss
        watch = sandbox_tree.TreeWatch({"memory_mb": 64, "max_processes": 100}, lambda: pids)
        watch.next = 0.0
        assert watch.check() == "memory"
        watch = sandbox_tree.TreeWatch({"memory_mb": 10**6, "max_processes": 5}, lambda: pids)
        watch.next = 0.0
        assert watch.check() == "processes"
        watch = sandbox_tree.TreeWatch({"memory_mb": 10**6, "max_processes": 100}, lambda: pids)
        watch.next = 0.0
        assert watch.check() is None
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


# ---------------------------------------------------------------------------------------------------------------
# Assert tests name their entry point: a test set without one is refused when it is loaded.


def test_assert_tests_without_an_entry_point_are_refused_at_load(tmp_path):
    from areal_core.data.records import RecordError, read_records

    good = {
        "id": "a",
        "task": "code",
        "prompt": "square",
        "tests": [{"testtype": "assert", "code": "assert square(7) == 49", "entry_point": "square"}],
    }
    bad = {**good, "id": "b", "tests": [{"testtype": "assert", "code": "assert square(7) == 49"}]}
    path = tmp_path / "recs.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(RecordError, match=r"recs\.jsonl.*line 2.*field 'tests\.0\.entry_point': expected the name"):
        read_records(str(path))


def test_the_shipped_assert_benchmarks_name_their_entry_points():
    from areal_core.data.sources import read_source

    humaneval, leetcode = read_source("humaneval"), read_source("leetcode")
    assert all(r.tests[0]["entry_point"] == r.meta["entry_point"] for r in humaneval)
    assert {r.tests[0]["entry_point"] for r in leetcode} == {"Solution"}


def test_a_verdicts_text_is_valid_and_bounded():
    r = RewardResult(correct=0, reason="test 0: \ud800" + "x" * 5000, parsed="a\udfffb")
    assert r.correct is False and r.reason.startswith("test 0: ?") and len(r.reason) == 1000
    assert r.parsed == "a?b"
    r.reason.encode("utf-8")
