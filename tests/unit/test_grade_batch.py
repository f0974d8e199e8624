"""Batched grading of functional tests (``code.grade_functional_many``): the verdicts of grading each
program alone, in one sandbox run per group, with no way for one program of a batch to change
another's verdict (every forgery of the hostile suite and attacks on the programs before and after
it; tests/e2e/test_sandbox_isolation.py runs the attacks on isolation itself, in every mode)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace

import pytest

from areal_core.reward import code as code_mod
from areal_core.reward import sandbox
from areal_core.reward.code import grade_code, grade_functional_many
from areal_core.reward.dispatch import grade_batch
from areal_core.reward.sandbox import SandboxLimits, guarantees
from tests.e2e.test_sandbox_hostile import FORGERS, FORGERY_LIMITS, PROGRAMS, STYLES

pytestmark = pytest.mark.skipif(
    not guarantees()["own_user"],
    reason="batched grading needs a sandbox user id of its own (root); elsewhere "
    "grade_functional_many grades one by one",
)

TESTS = [
    {"testtype": "functional", "input": "1\n2", "output": "5", "fn_name": "f"},
    {"testtype": "functional", "input": "3\n0", "output": "7", "fn_name": "f"},
    {"testtype": "functional", "input": "0\n0", "output": "1", "fn_name": "f"},
]
LIMITS = SandboxLimits(
    wall_s=2.0, cpu_s=2, memory_mb=256, max_processes=16, file_size_mb=1, disk_mb=8, max_open_files=64
)
MIXED = {
    "right": "def f(x, y):\n    return 2 * x + y + 1\n",
    "wrong": "def f(x, y):\n    return 0\n",
    "first_test_only": "def f(x, y):\n    return 5 if x == 1 else -1\n",
    "raises": "def f(x, y):\n    raise ValueError('no')\n",
    "syntax_error": "def f(x, y)\n    return 1\n",
    "no_function": "def g(x, y):\n    return 2 * x + y + 1\n",
    "class_solution": "class Solution:\n    def f(self, x, y):\n        return 2 * x + y + 1\n",
    "prints_and_answers": "print('noise')\ndef f(x, y):\n    print('more noise')\n    return 2 * x + y + 1\n",
    "loops_on_second": "def f(x, y):\n    while x == 3:\n        pass\n    return 2 * x + y + 1\n",
    "float_close": "def f(x, y):\n    return 2 * x + y + 1 + 1e-12\n",  # an expected integer is compared exactly
    "float_equal": "def f(x, y):\n    return float(2 * x + y + 1)\n",  # ... and a float equal to it is equal
    "huge_int": "def f(x, y):\n    return 10**400\n",  # no float holds it: compared exactly, never an OverflowError
}


def _key(r):
    return r.passed, r.n_passed, r.n_tests


@contextlib.contextmanager
def _counted():
    """Sandbox runs started meanwhile: batched (``run_each``) and single (``run_python_file``)."""
    runs = {"batched": 0, "single": 0}
    real_each, real_single = code_mod.run_each, code_mod.run_python_file

    def each(*a, **k):
        runs["batched"] += 1
        return real_each(*a, **k)

    def single(*a, **k):
        runs["single"] += 1
        return real_single(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(code_mod, "run_each", each)
        mp.setattr(code_mod, "run_python_file", single)
        yield runs


def test_batched_verdicts_equal_one_by_one():
    names = list(MIXED)
    programs = [MIXED[n] for n in names]
    alone = [grade_code(p, TESTS, LIMITS) for p in programs]
    with _counted() as runs:
        together = grade_functional_many(programs, [TESTS] * len(programs), LIMITS)
    assert runs == {"batched": 1, "single": 0}  # one sandbox run for all of them
    assert {n: _key(r) for n, r in zip(names, together)} == {n: _key(r) for n, r in zip(names, alone)}
    assert [r.passed for r in together] == [
        n in ("right", "class_solution", "prints_and_answers", "float_equal") for n in names
    ]
    by_name = dict(zip(names, together))
    assert by_name["loops_on_second"].n_passed == 1 and by_name["first_test_only"].n_passed == 1
    assert by_name["raises"].reason == alone[names.index("raises")].reason


# attacks on the programs that come before and after in the same batch
CROSS = {
    # a daemon outliving its program, killing every process it can see but the runner, for a while
    "daemon_kills_later": (
        "import os, time\nspare = (os.getppid(), os.getpid())\nif os.fork() == 0:\n    os.setsid()\n"
        "    end = time.time() + 4\n    while time.time() < end:\n"
        "        for p in os.listdir('/proc'):\n            if p.isdigit() and int(p) not in spare and int(p) != os.getpid():\n"
        "                try:\n                    os.kill(int(p), 9)\n                except OSError:\n                    pass\n"
        "    os._exit(0)\ntime.sleep(0.5)  # (the daemon leaves the program's process group meanwhile)\n"
        "def square(x):\n    return 0\n"
    ),
    # a daemon writing fake result lines on every fd number, and into every pipe it can find in /proc
    "daemon_fakes_later": (
        'import os, time\nfake = b\'{"i": 0, "value": 49}\\n{"i": 1, "value": 144}\\n\'\nif os.fork() == 0:\n'
        "    os.setsid()\n    end = time.time() + 4\n    while time.time() < end:\n        for fd in range(1, 64):\n"
        "            try:\n                os.write(fd, fake)\n            except OSError:\n                pass\n"
        "        for p in os.listdir('/proc'):\n            for fd in range(0, 16):\n                try:\n"
        "                    w = os.open(f'/proc/{p}/fd/{fd}', os.O_WRONLY | os.O_NONBLOCK)\n"
        "                    os.write(w, fake)\n                    os.close(w)\n                except OSError:\n"
        "                    pass\n    os._exit(0)\ntime.sleep(0.5)\ndef square(x):\n    return 0\n"
    ),
    # modules planted where a later program or the runner might import them from
    "plant_modules": (
        'import os\nevil = \'def dumps(*a, **k):\\n    return "{\\\\"i\\\\": 0, \\\\"value\\\\": 49}"\\nloads = dumps\\n\'\n'
        "for d in ('.', '..', '/tmp', '/tmp/work'):\n    for name in ('json.py', 'math.py', 'solution.py', 'runner.py'):\n"
        "        try:\n            open(os.path.join(d, name), 'w').write(evil)\n        except OSError:\n            pass\n"
        "def square(x):\n    return 0\n"
    ),
    # the zygote is its parent: kill it, or stop it (it is root's: neither reaches it)
    "kill_the_runner": "import os\ntry:\n    os.kill(os.getppid(), 9)\nexcept OSError:\n    pass\ndef square(x):\n    return 0\n",
    "stop_the_runner": "import os\ntry:\n    os.kill(os.getppid(), 19)\nexcept OSError:\n    pass\ndef square(x):\n    return 0\n",
}


def _hostile_batch(names):
    """Each attacker between two correct programs (it runs after one and before one), all in one
    ``grade_functional_many`` call; the sandbox runs it took."""
    tests, control = STYLES["functional"]
    sources = {**FORGERS, **CROSS, **PROGRAMS}
    programs, labels = [control], ["control"]
    for n in names:
        programs += [sources[n], control]
        labels += [n, "control"]
    with _counted() as runs:
        results = grade_functional_many(programs, [tests] * len(programs), FORGERY_LIMITS)
    return labels, results, runs


@pytest.mark.parametrize(
    "group",
    [
        sorted(FORGERS),
        ["daemon_kills_later", "daemon_fakes_later", "plant_modules"],
        ["kill_the_runner", "stop_the_runner"],
        # resource attacks: what one program does to the processes, memory and disk of the run
        [
            "fork_bomb",
            "thread_bomb",
            "memory_bomb",
            "disk_fill_many_files",
            "one_huge_file",
            "huge_output",
            "huge_stderr",
            "infinite_loop",
            "sleep_past_limit",
            "kill_parent",
        ],
    ],
    ids=["forgeries", "cross_program", "runner_attacks", "resources"],
)
@pytest.mark.slow
def test_no_program_changes_another_programs_verdict(group):
    labels, results, runs = _hostile_batch(group)
    assert runs == {"batched": 1, "single": 0}  # nothing broke the batch: it was not graded again one by one
    for label, r in zip(labels, results):
        if label == "control":
            assert r.passed and r.n_passed == r.n_tests, (label, r)
        else:
            assert not r.passed and r.n_passed == 0, (label, r)


def test_a_batch_that_fails_as_a_whole_is_graded_one_by_one(monkeypatch):
    programs = [MIXED["right"], MIXED["wrong"], MIXED["class_solution"]]
    # a roomy wall-time limit: the test is about the fallback, and on a loaded machine a program's
    # sandbox start alone can pass 2 s, which would turn a verdict into a timeout on one side only
    limits = replace(LIMITS, wall_s=20.0)
    alone = [_key(grade_code(p, TESTS, limits)) for p in programs]
    monkeypatch.setattr(code_mod, "run_each", lambda *a, **k: None)  # what run_each says for a failed run
    assert [_key(r) for r in grade_functional_many(programs, [TESTS] * 3, limits)] == alone


def test_each_program_of_a_batch_runs_under_a_user_id_of_its_own():
    job = {
        "source": code_mod.PREAMBLE + "import os\ndef f(x, y):\n    return os.getuid()\n",
        "fn_name": "f",
        "cases": ["1\n2"],
    }
    runs = sandbox.run_each(
        code_mod.RUNNER_SOURCE, "batch_prepare", "batch_functional", [json.dumps(job).encode()] * 4, LIMITS
    )
    uids = [json.loads(r.stdout)["value"] for r in runs]
    assert len(set(uids)) == 4 and min(uids) >= 2_000_000


def test_run_each_refuses_without_user_ids_of_its_own(monkeypatch):
    monkeypatch.setattr(sandbox, "guarantees", lambda mode=None: {"own_user": False})
    with pytest.raises(ValueError, match="user ids of its own"):
        sandbox.run_each(code_mod.RUNNER_SOURCE, "batch_prepare", "batch_functional", [b"{}"], LIMITS)


def test_grade_batch_batches_functional_code_and_keeps_the_order():
    items = [("chain", "a1=1|1", "a1=1|1", None)]
    items += [("code", f"```python\n{MIXED[n]}```", "", TESTS) for n in ("right", "wrong", "first_test_only")]
    items += [("chain", "a1=2|2", "a1=1|1", None)]
    with _counted() as runs:
        out = grade_batch(items, timeout_s=30)
        partial = grade_batch(items, timeout_s=30, code_reward="fraction")
    assert [r.correct for r in out] == [True, True, False, False, False]
    assert [r.score for r in partial[1:4]] == [1.0, 0.0, pytest.approx(1 / 3)]
    # one batched run each time, plus partial credit's re-runs after a failing test, one by one (wrong: from
    # tests 1 and 2; first_test_only: from test 2)
    assert runs == {"batched": 2, "single": 3}
