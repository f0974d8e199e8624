"""The grader-hardening programs (tests/grader_attacks.py) through every path, in every sandbox mode this machine
runs: batched (one ``grade_functional_many`` call: CONTROL, A1, CONTROL, A2, ..., CONTROL), single (``grade_code``:
CONTROL, the attack, CONTROL, one after another), the Dask reward service (one ``submit_batch``, every style mixed)
and the tool episode (one ``PythonTool.run`` of control and attack calls, alternating).

Each attack is graded failed with no test passed and its grading ends in a verdict: no exception leaves the grader,
no batched run fails as a whole (and is graded again one by one), every control passes, no process survives. Then
what each class must show: exact comparisons, the seccomp filter's refusals, the limit on an answer's processes
together. The ``live`` tests show each class's attack working where its guard is absent.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from areal_core.episodes.tool import PythonTool
from areal_core.reward import sandbox
from areal_core.reward.code import grade_code, grade_functional_many
from areal_core.reward.config import RewardConfig
from areal_core.reward.sandbox import guarantees, sandbox_mode, sandbox_python
from tests.e2e.test_sandbox_hostile import FORGERY_LIMITS, STYLES, _modes, _recorded_markers, _sandbox_processes
from tests.grader_attacks import (
    ASSERT_FREE_NAME,
    ASSERT_MAP,
    ATTACKS,
    CONTROL,
    KERNEL_CALLS,
    KERNEL_REFUSED,
    TOOL,
    TOOL_CROSS,
    TOOL_LEAVES_SECRET,
    classes,
    kernel_probe,
)

TESTS = {**{style: tests for style, (tests, _) in STYLES.items()}, "assert_map": ASSERT_MAP}
TESTS["assert_free_name"] = ASSERT_FREE_NAME
CONTROLS = {style: control for style, (_, control) in STYLES.items()} | {"assert_map": CONTROL}
JOBS = [(style, name) for name, (_, _, styles) in ATTACKS.items() for style in styles]
LIMIT = "memory limit exceeded (all its processes together)"
CONTROL_CALL = "print(7 * 7)"
# the hostile suite's limits, with room on the wall clock: the memory bombs must meet the limit on their processes
# together before their wall time, also on a loaded machine
LIMITS = replace(FORGERY_LIMITS, wall_s=10.0)


def _mode_params() -> list:
    """Every mode this machine runs: the best one in make test, the weaker ``rlimits`` (where it is not the best)
    nightly (the hostile suites of test_sandbox_hostile.py already run each attack there in make test)."""
    best, *others = _modes()
    return [pytest.param(best, id=best), *(pytest.param(m, id=m, marks=pytest.mark.nightly) for m in others)]


@pytest.fixture(scope="module", params=_mode_params())
def mode(request):
    old = os.environ.get("AREAL_SANDBOX_MODE")
    os.environ["AREAL_SANDBOX_MODE"] = request.param
    sandbox_mode.cache_clear()
    try:
        yield request.param
    finally:
        if old is None:
            os.environ.pop("AREAL_SANDBOX_MODE", None)
        else:
            os.environ["AREAL_SANDBOX_MODE"] = old
        sandbox_mode.cache_clear()


def _with_controls(style: str, program: str) -> list:
    """The attack between two controls, one sandbox run each (the single path)."""
    return [
        grade_code(p, TESTS[style], LIMITS)
        for p in (CONTROLS.get(style, CONTROL), program, CONTROLS.get(style, CONTROL))
    ]


@pytest.fixture(scope="module")
def graded(mode):
    launches, real = [], sandbox._launch

    def counting(cmd, limits, marker):
        launches.append(marker)
        return real(cmd, limits, marker)

    functional = [name for style, name in JOBS if style == "functional"]
    sequence = [CONTROL]
    for name in functional:
        sequence += [ATTACKS[name][1], CONTROL]
    with _recorded_markers() as markers, pytest.MonkeyPatch.context() as mp:
        mp.setattr(sandbox, "_launch", counting)
        batched = grade_functional_many(sequence, [TESTS["functional"]] * len(sequence), LIMITS)
        batch_launches = len(launches)
        with ThreadPoolExecutor(4) as pool:
            singles = dict(zip(JOBS, pool.map(lambda job: _with_controls(job[0], ATTACKS[job[1]][1]), JOBS)))
    time.sleep(0.2)
    return {
        "mode": mode,
        "batched": {("functional", n): batched[2 * i + 1] for i, n in enumerate(functional)},
        "batched_controls": batched[0::2],
        "single": {job: runs[1] for job, runs in singles.items()},
        "single_controls": [
            r for job, runs in singles.items() for r in (runs[0], runs[2]) if job[0] != "assert_free_name"
        ],
        "batch_launches": batch_launches,
        "leftovers": _sandbox_processes(markers),
    }


def _got(result) -> str:
    return " ".join(str(d.get("got", "")) for d in result.details)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["batched", "single"])
def test_every_attack_is_graded_failed_and_every_control_passes(graded, path):
    controls = graded[f"{path}_controls"]
    assert controls and all(r.passed and r.n_passed == r.n_tests for r in controls), [r.reason for r in controls]
    for job, r in graded[path].items():
        assert not r.passed and r.n_passed == 0, (job, r)
        assert not r.reason.startswith("grading failed"), (job, r.reason)  # the grader decided: no exception
        r.reason.encode("utf-8")  # valid text whatever the program claimed (lone surrogates included)


@pytest.mark.slow
def test_the_batch_stays_one_sandbox_run_and_nothing_survives(graded):
    """exit 126 (a setup failure's code), killed process groups, memory bombs: none breaks the batch."""
    assert graded["batch_launches"] == (1 if guarantees(graded["mode"])["own_user"] else len(graded["batched"]) * 2 + 1)
    assert graded["leftovers"] == []


@pytest.mark.slow
def test_values_are_compared_exactly(graded):
    for path in ("batched", "single"):
        r = graded[path]
        for name in ("return_10_pow_400", "return_near_integer_float", "return_nan"):
            assert r[("functional", name)].reason == "test 0: wrong result", (path, name, r[("functional", name)])
        assert "Exceeds the limit" in r[("functional", "return_10_pow_5000")].reason  # the runner cannot write it
    assert graded["single"][("stdin", "print_near_integer_float")].reason == "test 0: wrong output"
    assert "?" in graded["single"][("functional", "forged_lone_surrogates")].reason  # the surrogates, replaced


@pytest.mark.slow
def test_control_flow_exceptions_are_candidate_errors(graded):
    for name in classes()["control_flow"]:
        r = graded["single"][("assert_map", name)]
        assert "CandidateError" in r.reason, (name, r.reason)


@pytest.mark.slow
def test_only_the_entry_point_is_taken(graded):
    r = graded["single"][("assert_free_name", "supply_free_name")]
    assert "NameError" in r.reason and "expected" in r.reason, r.reason


@pytest.mark.slow
def test_the_kernel_calls_are_refused(graded):
    if not guarantees(graded["mode"])["syscall_filter"]:
        pytest.skip(f"no seccomp filter in this mode here: {sandbox._probe_seccomp()}")
    for path in ("batched", "single"):
        for name in KERNEL_CALLS:
            assert _got(graded[path][("functional", name)]) == KERNEL_REFUSED[name], (path, name)


@pytest.mark.slow
def test_memory_of_all_the_processes_together_is_limited(graded):
    for job in [j for j in JOBS if j[1] in classes()["aggregate"]]:
        assert LIMIT in graded["single"][job].reason, (job, graded["single"][job].reason)
        if job in graded["batched"]:
            assert LIMIT in graded["batched"][job].reason, (job, graded["batched"][job].reason)


# ---------------------------------------------------------------------------------------------------------------
# The Dask reward service: every style's attacks and controls in one batch, as training submits a group.


@pytest.fixture(scope="module")
def service():
    from areal_core.reward.service import RewardService

    with RewardService(RewardConfig(n_workers=1, allow_weak_sandbox=True)) as rewards:
        yield rewards


@pytest.mark.slow
def test_the_reward_service_gives_each_answer_its_verdict(service, graded):
    def set_mode(mode: str) -> str:  # in the worker (a nested function travels by value)
        import os

        from areal_core.reward.sandbox import sandbox_mode

        os.environ["AREAL_SANDBOX_MODE"] = mode
        sandbox_mode.cache_clear()
        return sandbox_mode()

    assert set(service.client.run(set_mode, graded["mode"]).values()) == {graded["mode"]}
    items, labels = [], []
    for style, name in JOBS:
        items += [("code", f"```python\n{ATTACKS[name][1]}```", "", TESTS[style])]
        items += [("code", f"```python\n{CONTROLS.get(style, CONTROL)}```", "", TESTS[style])]
        labels += [(style, name), (style, "control")]
    got, done = [], threading.Event()
    service.submit_batch(items, on_done=lambda results, error: (got.append((results, error)), done.set()))
    assert done.wait(600)
    ((results, error),) = got
    assert error is None and len(results) == len(items)
    for (style, name), r in zip(labels, results):
        if name == "control":
            assert r.correct == (style != "assert_free_name"), (style, r)
        else:
            assert not r.correct and not r.reason.startswith("grading failed"), (style, name, r)
    assert service.n_failed == 0


# ---------------------------------------------------------------------------------------------------------------
# The tool episode: attack calls between control calls, one PythonTool.run.


@pytest.mark.slow
def test_tool_calls_get_each_their_output(mode, caplog):
    # a call's time is generous: the last call walks the host's /tmp (rlimits), tens of thousands of files on
    # a machine that ran the test suite; no call here runs to its timeout
    tool = PythonTool(timeout_s=15.0, max_output_chars=200, memory_mb=LIMITS.memory_mb, mode=mode)
    calls = [CONTROL_CALL]
    for name in TOOL:
        calls += [ATTACKS[name][1], CONTROL_CALL]
    calls += [TOOL_LEAVES_SECRET, TOOL_CROSS["leave_a_killer"], CONTROL_CALL, TOOL_CROSS["read_the_call_before"]]
    with _recorded_markers() as markers:
        out = tool.run(calls)
    time.sleep(0.2)
    assert tool.n_sandbox_runs == (1 if guarantees(mode)["own_user"] else len(calls)), caplog.text
    assert _sandbox_processes(markers) == []
    assert [r.output for r, c in zip(out, calls) if c == CONTROL_CALL] == ["49"] * calls.count(CONTROL_CALL)
    assert not any(r.failed for r in out)
    by_name = {name: out[2 * i + 1] for i, name in enumerate(TOOL)}
    if guarantees(mode)["syscall_filter"]:
        for name in KERNEL_CALLS:
            assert by_name[name].output == KERNEL_REFUSED[name], (name, by_name[name])
    for name in classes()["aggregate"]:
        assert LIMIT in by_name[name].output, (name, by_name[name])
    assert out[-1].output == "nothing"  # the call before it left its secret in its /tmp: gone, or out of reach


KILLER = (
    "import os, sys\nme = os.getpid()\nprint('ready', flush=True)\nwhile True:\n    for p in os.listdir('/proc'):\n"
    "        if p.isdigit() and int(p) != me:\n            try:\n                os.kill(int(p), 9)\n"
    "            except OSError:\n                pass\n"
)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and util-linux setpriv")
def test_kill_uid_ends_processes_that_kill_whatever_of_their_user_id_they_see():
    """``sandbox_proc.kill_uid`` (the batch's sweep after each program, the launcher's at a limit) against a
    process that kills every process of its user id it sees, the sweep's own helper included."""
    uid = str(2_100_000 + os.getpid() % 1000)
    helpers = os.path.dirname(os.path.abspath(sandbox.__file__))
    sweep = f"import sys; sys.path.append({helpers!r}); import sandbox_proc; sandbox_proc.kill_uid({uid})"
    drop = ["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups"]
    for _ in range(5):  # the earlier sweep (one helper, raising when it was killed) failed most of these rounds
        killer = subprocess.Popen([*drop, sandbox_python(), "-I", "-S", "-c", KILLER], stdout=subprocess.PIPE, cwd="/")
        killer.stdout.readline()
        out = subprocess.run([sandbox_python(), "-I", "-S", "-c", sweep], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert killer.wait(timeout=10) == -9


def test_the_docs_table_lists_every_program_and_class():
    text = (Path(__file__).resolve().parents[2] / "docs" / "EVALUATION.md").read_text()
    table = text[text.index("### Attacks on verdicts, the kernel and the limits") :]
    assert [n for n in [*ATTACKS, *classes()] if f"`{n}`" not in table and f"| {n} |" not in table] == []


# ---------------------------------------------------------------------------------------------------------------
# The attacks are live: where their guard is absent, they work.


def _unprivileged_probe(code: str) -> str:
    """What ``code`` (a kernel probe) prints, run outside the sandbox as a user id of its own with no new
    privileges, as a sandboxed program is, but without the seccomp filter."""
    uid = str(2_000_000 + os.getpid() % 1000)
    drop = ["setpriv", "--reuid", uid, "--regid", uid, "--clear-groups", "--no-new-privs"]
    out = subprocess.run(
        [*drop, sandbox_python(), "-I", "-c", code], capture_output=True, text=True, timeout=30, cwd="/"
    )
    return out.stdout.strip()


@pytest.mark.skipif(
    os.geteuid() != 0 or not KERNEL_CALLS or shutil.which("setpriv") is None,
    reason="needs root and util-linux setpriv (to run the probes as another uid), and a known architecture",
)
def test_live_the_kernel_calls_work_without_the_filter():
    got = {name: _unprivileged_probe(kernel_probe(name) + "print(_RESULT)\n") for name in KERNEL_CALLS}
    works = {name for name, r in got.items() if r == "ok"}
    # what an unprivileged program reaches here without the filter (the rest needs a capability, or a sysctl
    # keeps it out on this kernel)
    assert {"unshare_user_namespace", "clone_new_namespaces", "ptrace_traceme", "keyctl_join_session"} <= works, got


def test_live_the_old_comparisons_fail_on_these_values():
    with pytest.raises(OverflowError):
        math.isclose(10**400, 49, rel_tol=1e-6, abs_tol=1e-6)  # the old comparison raised out of the grader
    assert math.isclose(49 * (1 + 4e-7), 49, rel_tol=1e-6, abs_tol=1e-6)  # ... and took a near miss for 49


def test_live_a_stop_iteration_ends_the_tests_map_in_a_shared_interpreter():
    ns: dict = {}
    exec(ATTACKS["raise_stop_iteration"][1], ns)
    exec(ASSERT_MAP[0]["code"], ns)  # no AssertionError: all() of an empty map


def test_live_a_test_taking_free_names_from_the_program_passes_it():
    ns: dict = {}
    exec(ATTACKS["supply_free_name"][1], ns)
    exec(ASSERT_FREE_NAME[0]["code"], ns)


@pytest.mark.slow
def test_live_per_process_limits_alone_let_the_processes_together_past_the_memory_limit(tmp_path):
    """The fork memory bomb outside the sandbox, each process under RLIMIT_AS = the sandbox's memory limit: the
    processes together hold more than it (what the launcher's limit on the whole tree stops)."""
    from areal_core.reward import sandbox_tree

    limit = LIMITS.memory_mb * 2**20
    program = ATTACKS["fork_memory_bomb"][1].replace("time.sleep(30)\ndef", "time.sleep(3)\ndef")
    program = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))\n" + program
    proc = subprocess.Popen([sandbox_python(), "-I", "-c", program], start_new_session=True)
    try:
        peak, deadline = 0, time.monotonic() + 20
        while time.monotonic() < deadline and peak <= limit and proc.poll() is None:
            pids = [proc.pid, *sandbox_tree.descendant_pids(proc.pid)]
            peak = max(peak, sandbox_tree.usage(pids, 0)[1])
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert peak > limit, (peak, limit)
