"""Grading isolation against programs that know our code (tests/sandbox_attacks.py), in every mode this machine
runs, through both grading paths, with a correct program before and after each attack:

* batched: one ``grade_functional_many`` call (one sandbox run) grading CONTROL, A1, CONTROL, A2, ..., CONTROL;
* single: for each attack, ``grade_code`` on CONTROL, then the attack, then CONTROL, one after another.

Where the mode gives the guarantees an attack needs (``sandbox.guarantees``), the attack is graded failed with no
test passed, its probe reports nothing, no listener is reached; where it does not, the test asserts what
docs/EVALUATION.md says happens. Every CONTROL passes; no process survives.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from areal_core.reward import sandbox
from areal_core.reward.code import grade_code, grade_functional_many
from areal_core.reward.config import RewardConfig
from areal_core.reward.dispatch import grade_batch
from areal_core.reward.result import RewardResult
from areal_core.reward.sandbox import SandboxLimits, WeakSandboxError, guarantees, sandbox_mode
from tests.e2e.test_sandbox_hostile import _Listener, _modes, _recorded_markers, _sandbox_processes
from tests.sandbox_attacks import ANSWER_FILE, ATTACKS, CONTROL, TESTS, fill

REPO = str(Path(__file__).resolve().parents[2])
LIMITS = SandboxLimits(
    wall_s=3.0, cpu_s=3, memory_mb=512, max_processes=16, file_size_mb=4, disk_mb=8, max_open_files=64
)
SECRET = "run-folder-secret-5d1c"
PATHS = ("batched", "single")
STANDS_FOR = ("scheduler", "worker", "rollout server", "proxy")  # one listener each


def _params():
    out = [pytest.param(m, id=m) for m in _modes()]
    if os.geteuid() == 0:
        out.append(
            pytest.param(
                "rlimits-unprivileged",
                id="rlimits-unprivileged",
                marks=pytest.mark.skip(
                    reason="the tests run as root here: rlimits without root needs the grader itself to run unprivileged; "
                    "its column in docs/EVALUATION.md follows from sandbox.guarantees (no own user id: no batching, "
                    "no network namespace)"
                ),
            )
        )
    return out


def _targets(ports: list[int]) -> list[tuple[str, int]]:
    """Every address of this machine, at each listener's port (listeners are on all addresses)."""
    hosts = {"127.0.0.1"}
    try:
        hosts |= {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        pass
    return [(h, p) for h in sorted(hosts) for p in ports]


def _clean_host_tmp() -> None:
    """What the programs may have left in world-writable host folders (rlimits mode): their own files only."""
    names = [ANSWER_FILE, "json.py", "math.py", "solution.py", "runner.py"]
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        for path in (os.path.join(d, n) for n in names):
            try:
                if os.stat(path).st_uid >= 2_000_000:  # a sandbox user id's
                    os.unlink(path)
            except FileNotFoundError:
                pass


@pytest.fixture(scope="module", params=_params())
def matrix(request):
    mode = request.param
    old = os.environ.get("AREAL_SANDBOX_MODE")
    os.environ["AREAL_SANDBOX_MODE"] = mode
    sandbox_mode.cache_clear()
    run_dir = tempfile.mkdtemp(prefix="areal-run-", dir="/tmp")  # a run folder anyone may read, as runs often are
    os.chmod(run_dir, 0o755)
    Path(run_dir, "secret.txt").write_text(SECRET)
    os.chmod(os.path.join(run_dir, "secret.txt"), 0o644)
    listeners = [_Listener(host="0.0.0.0") for _ in STANDS_FOR]
    targets = _targets([x.port for x in listeners])
    # an attack that touches the processes it reaches runs only where the sandbox has user ids of its own (else
    # it would reach the grader's and this machine's other processes)
    names = [n for n, a in ATTACKS.items() if guarantees(mode)["own_user"] or not a.touches_others]
    programs = {n: fill(n, REPO, run_dir, targets) for n in names}
    launches = []
    real_launch = sandbox._launch

    def counting(cmd, limits, marker):
        launches.append(marker)
        return real_launch(cmd, limits, marker)

    def single(name):
        return [grade_code(p, TESTS, LIMITS) for p in (CONTROL, programs[name], CONTROL)]

    try:
        with _recorded_markers() as markers, pytest.MonkeyPatch.context() as mp:
            mp.setattr(sandbox, "_launch", counting)
            sequence = [CONTROL]
            for name in names:
                sequence += [programs[name], CONTROL]
            t0 = time.monotonic()
            batched = grade_functional_many(sequence, [TESTS] * len(sequence), LIMITS)
            batch_s, batch_launches = time.monotonic() - t0, len(launches)
            with ThreadPoolExecutor(4) as pool:
                singles = dict(zip(names, pool.map(single, names)))
        time.sleep(0.2)
        results = {
            "batched": {n: batched[2 * i + 1] for i, n in enumerate(names)},
            "single": {n: singles[n][1] for n in names},
        }
        controls = {"batched": batched[0::2], "single": [r for n in names for r in singles[n][0::2]]}
        yield {
            "mode": mode,
            "g": guarantees(mode),
            "results": results,
            "controls": controls,
            "batch_launches": batch_launches,
            "batch_s": batch_s,
            "listeners": listeners,
            "leftovers": _sandbox_processes(markers),
        }
    finally:
        for x in listeners:
            x.close()
        for f in glob.glob(os.path.join(run_dir, "*")):
            os.unlink(f)
        os.rmdir(run_dir)
        _clean_host_tmp()
        if old is None:
            os.environ.pop("AREAL_SANDBOX_MODE", None)
        else:
            os.environ["AREAL_SANDBOX_MODE"] = old
        sandbox_mode.cache_clear()


def _got(result) -> str:
    return " ".join(str(d.get("got", "")) for d in result.details)


@pytest.mark.parametrize("path", PATHS)
def test_every_control_passes(matrix, path):
    controls, n = matrix["controls"][path], len(matrix["results"][path])
    assert len(controls) == (n + 1 if path == "batched" else 2 * n)
    assert all(r.passed and r.n_passed == r.n_tests for r in controls), [r.reason for r in controls]


def test_the_batch_is_one_sandbox_run(matrix):
    """No attack broke the batched run (it would be graded again one by one: the batched path untested)."""
    if not matrix["g"]["own_user"]:
        pytest.skip("no batching without user ids of its own: every program had a run of its own")
    assert matrix["batch_launches"] == 1


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack(matrix, name, path):
    if name not in matrix["results"][path]:
        assert ATTACKS[name].touches_others and not matrix["g"]["own_user"]
        pytest.skip("it would reach the grader's own processes (no user id of its own in this mode)")
    attack, result = ATTACKS[name], matrix["results"][path][name]
    if all(matrix["g"][k] for k in attack.needs):
        assert not result.passed and result.n_passed == 0, (name, result)
        if attack.weak == "reaches":
            assert _got(result) == "[]", (name, _got(result))
    elif attack.weak == "passes":
        assert result.passed, (name, result)  # documented: this mode does not keep it out
    elif attack.weak == "reaches":
        assert _got(result) not in ("", "[]"), (name, result)


def test_no_listener_reached(matrix):
    n = sum(x.connections for x in matrix["listeners"])
    strays = [b for x in matrix["listeners"] for b in x.strays]
    if matrix["g"]["no_network"]:
        assert n == 0, f"{n} attack connections (and {len(strays)} from elsewhere: {strays[:4]})"
    else:  # documented: no network namespace in this mode here
        assert n > 0


def test_no_process_survives(matrix):
    assert matrix["leftovers"] == []


def test_no_attack_holds_the_answers():
    """A forger may pass only by reaching something: none of them holds the expected outputs itself."""
    for name in ATTACKS:
        src = fill(name, REPO, "/tmp/run", [("127.0.0.1", 1)])
        assert "49" not in src and "144" not in src, name


def test_the_docs_table_lists_every_attack():
    text = (Path(REPO) / "docs" / "EVALUATION.md").read_text()
    assert [n for n in ATTACKS if f"`{n}`" not in text] == []


# The attacks are live: where what they look for is within reach (in the harness's memory, a pipe it holds, an
# open file, a file beside it, the checkout), each forger passes and each probe reports, so a failure in the
# sandbox is containment, not a broken attack. They run outside the sandbox here, so only those that read, and
# in a PID namespace of their own (they see no process but the harness's).
LIVE = r"""
import json, os, sys
held = [{"out": '{"i": 0, "value": 49}\n{"i": 1, "value": 144}\n'}]  # another program's results, in memory
r, w = os.pipe()
os.write(w, held[0]["out"].encode())  # ... in a pipe this process holds
os.close(w)
fd = os.open("held.txt", os.O_RDWR | os.O_CREAT)
os.write(fd, held[0]["out"].encode())  # ... in an open file, in a file beside it
ns = {"__name__": "solution"}
exec(compile(open(sys.argv[1]).read(), "solution.py", "exec"), ns)
print(json.dumps([ns["square"](7), ns["square"](12)]))
"""
ALONE = ["unshare", "--pid", "--fork", "--mount", "--mount-proc"]  # a PID namespace: no other process in reach
needs_alone = pytest.mark.skipif(
    sandbox._probe_namespaces() is not None,
    reason="needs root and util-linux unshare, to run unsandboxed attacks alone",
)


@needs_alone
@pytest.mark.parametrize("name", [n for n, a in ATTACKS.items() if a.live])
def test_each_forger_passes_where_its_target_is_within_reach(name, tmp_path):
    (tmp_path / "attack.py").write_text(fill(name, REPO, str(tmp_path), []))
    out = subprocess.run(
        [*ALONE, sys.executable, "-c", LIVE, "attack.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == [49, 144]


@needs_alone
def test_the_probes_report_where_their_targets_are_within_reach(tmp_path):
    listener = _Listener(host="0.0.0.0")
    try:
        Path(tmp_path, "secret.txt").write_text(SECRET)
        for name, want in (("host_files_probe", f"{REPO}/tests/sandbox_attacks.py"), ("network", "connected")):
            (tmp_path / "attack.py").write_text(fill(name, REPO, str(tmp_path), _targets([listener.port])))
            code = "import sys\nns = {}\nexec(open(sys.argv[1]).read(), ns)\nprint(ns['square'](7))\n"
            out = subprocess.run(
                [*ALONE, sys.executable, "-c", code, "attack.py"],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert want in out.stdout, (name, out.stdout, out.stderr[-2000:])
        assert listener.connections > 0
    finally:
        listener.close()


# ---------------------------------------------------------------------------------------------------------------
# A weak sandbox is refused in training unless the config allows it.


def test_training_refuses_a_weak_sandbox_unless_allowed(monkeypatch, caplog):
    items = [("code", f"```python\n{CONTROL}```", "", TESTS)] * 2
    assert sandbox.missing_guarantees("namespaces") == []
    monkeypatch.setenv("AREAL_SANDBOX_MODE", "rlimits")
    sandbox_mode.cache_clear()
    try:
        assert "host_files_hidden" in sandbox.missing_guarantees()
        with pytest.raises(WeakSandboxError, match=r"hidden host files.*reward.allow_weak_sandbox: true"):
            grade_batch(items, 30.0, allow_weak_sandbox=False)
        monkeypatch.setattr(sandbox, "_warned", set())
        with caplog.at_level(logging.WARNING, logger="areal_core.reward.sandbox"):
            assert [r.correct for r in grade_batch(items, 30.0, allow_weak_sandbox=True)] == [True, True]
        assert "allow_weak_sandbox: true" in caplog.text and "hidden host files" in caplog.text
        # the library call that does not ask (benchmarks, these tests): graded; the reward service always asks
        assert [r.correct for r in grade_batch(items, 30.0)] == [True, True]
    finally:
        monkeypatch.delenv("AREAL_SANDBOX_MODE")
        sandbox_mode.cache_clear()
        _clean_host_tmp()


def test_allow_weak_sandbox_is_a_typed_field_off_by_default():
    from pydantic import ValidationError

    assert RewardConfig().allow_weak_sandbox is False
    assert RewardConfig(allow_weak_sandbox=True).allow_weak_sandbox is True
    with pytest.raises(ValidationError):
        RewardConfig(allow_weak_sandbox="yes")


def test_every_path_of_the_service_grades_with_the_configs_choice():
    """Training (submit_batch) and evaluation (submit, grade_many) alike send reward.allow_weak_sandbox."""
    from types import SimpleNamespace

    from areal_core.reward.service import RewardService

    for allow in (False, True):
        svc = RewardService.__new__(RewardService)  # no cluster: only what the paths send
        svc.cfg, svc.n_tasks, svc._pending, svc._in_flight, svc._max_in_flight = (
            RewardConfig(allow_weak_sandbox=allow, code_reward="fraction"),
            0,
            [],
            0,
            1,
        )
        svc._coalesce_lock = threading.Lock()
        svc.n_timed_out = svc.n_failed = 0
        sent = []

        class _Done:
            def __init__(self, items):
                self.items = items

            def add_done_callback(self, fn):
                fn(self)

            def result(self):
                return [RewardResult(correct=True)] * len(self.items)

        def submit(fn, *args, sent=sent, **kwargs):
            sent.append((fn, args))
            return _Done(args[0])

        svc.client = SimpleNamespace(submit=submit, map=lambda fn, *cols, **k: [submit(fn, *a) for a in zip(*cols)])
        item = ("code", CONTROL, "", TESTS)
        svc.submit_batch([item], on_done=lambda results, error: None)  # training: the config's credit
        svc.submit(*item[:3], on_done=lambda result, error: None, tests=TESTS)  # evaluation: verdicts
        svc.grade_many("code", [CONTROL], [""], [TESTS])
        assert sent == [
            (grade_batch, ([item], 30.0, "fraction", allow)),
            (grade_batch, ([item], 30.0, "all_pass", allow)),
            (grade_batch, ([item], 30.0, "all_pass", allow)),
        ]


def test_a_weak_sandbox_is_refused_before_anything_is_generated_in_training_and_evaluation(monkeypatch, caplog):
    """``RewardService.warm_up`` (the run and ``areal-flow eval`` call it before generating) asks the workers
    what their sandbox lacks and refuses at once, in training and evaluation alike; every grading path refuses
    too; an explicit allowance (reward.allow_weak_sandbox, or AREAL_ALLOW_WEAK_SANDBOX=1 for a config's
    default) only warns."""
    from areal_core.reward.service import RewardService

    monkeypatch.setenv("AREAL_SANDBOX_MODE", "rlimits")  # the workers inherit it
    monkeypatch.delenv("AREAL_ALLOW_WEAK_SANDBOX", raising=False)
    with RewardService(RewardConfig(n_workers=1)) as rewards:
        with pytest.raises(WeakSandboxError, match=r"lacks: .*host_files_hidden.*training refuses.*allow_weak_sandbox"):
            rewards.warm_up({"math", "code"}, training=True)
        with pytest.raises(WeakSandboxError, match=r"lacks: .*host_files_hidden.*evaluation refuses"):
            rewards.warm_up({"code"})  # evaluation
        rewards.warm_up({"math"}, training=True)  # no code in the data: nothing to refuse
        with pytest.raises(WeakSandboxError, match="hidden host files"):
            rewards.grade_many("code", [f"```python\n{CONTROL}```"], [""], [TESTS])
    monkeypatch.setenv("AREAL_ALLOW_WEAK_SANDBOX", "1")
    assert RewardConfig().allow_weak_sandbox is True
    with RewardService(RewardConfig(n_workers=1)) as rewards:
        with caplog.at_level(logging.WARNING, logger="areal_core.reward.service"):
            rewards.warm_up({"code"})
        assert "lacks" in caplog.text
        assert [r.correct for r in rewards.grade_many("code", [f"```python\n{CONTROL}```"], [""], [TESTS])] == [True]
    _clean_host_tmp()
