"""Ctrl-C in the terminal that runs `areal-flow train`: the terminal signals its whole foreground
process group, so the test does the same (os.killpg) to a run started as its own group.

The run stops at a checkpoint of the step it was on, stops its servers and Dask itself, prints one
line that says how to continue, and exits with 130; `--resume` then finishes the run with every
trajectory trained exactly once. A second Ctrl-C exits at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = "tests/data/e2e.yaml"
STEPS, EVERY = 30, 4  # room after the checkpoint of step 4 for Ctrl-C to land mid-run


def _start(run_dir: Path, out: Path, *extra: str, prefect: bool = False) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "train",
        CONFIG,
        *([] if prefect else ["--no-prefect"]),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        str(STEPS),
        "--set",
        f"storage.checkpoint_every={EVERY}",
        *extra,
    ]
    return _in_own_group(cmd, out)


def _in_own_group(cmd: list[str], out: Path) -> subprocess.Popen:
    """``cmd`` as the terminal's foreground group, for the test; with no Prefect server named, as a
    user's shell has none: the command reports to one of its own."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    with open(out, "ab") as f:
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"no {path} after {timeout_s:.0f}s"
        time.sleep(0.1)


def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _alive(procs: list[psutil.Process]) -> list[str]:
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline()[:4])}")
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.mark.slow
def test_ctrl_c_stops_at_a_checkpoint_and_resume_finishes_exactly_once(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    proc = _start(run_dir, out)
    try:
        _wait_for(run_dir / "checkpoints" / f"v{EVERY}" / "manifest.json", proc, 300)  # training, mid-run
        children = _descendants(proc.pid)
        assert len(children) >= 2, children  # a rollout server and the Dask processes at least
        # the Dask scheduler and nannies and the rollout servers each lead a group of their own (they
        # were in the terminal's group: its Ctrl-C killed them first, with tracebacks, and the run hung)
        started = [c for c in children if any(w in " ".join(c.cmdline()) for w in ("dask spec", "embedded.server"))]
        assert len(started) >= 3 and all(os.getpgid(c.pid) == c.pid for c in started), started
        seen = out.stat().st_size
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    tail = out.read_bytes()[seen:].decode(errors="replace")
    assert rc == 130, (rc, tail)
    assert took < 10, f"exited {took:.1f}s after Ctrl-C"
    assert "Traceback" not in tail and "KeyboardInterrupt" not in tail, tail
    lines = [ln for ln in tail.replace("\r", "\n").split("\n") if ln.strip() and not ln.startswith("RL e2e")]
    assert len(lines) <= 3, lines  # (progress-bar redraws aside)
    stopped = [ln for ln in lines if ln.startswith("stopped at step ")]
    assert stopped and stopped[0].endswith("--resume") and f"--run-dir {run_dir}" in stopped[0], lines
    step = int(stopped[0].split()[3].rstrip(";"))
    assert EVERY <= step < STEPS
    time.sleep(1)  # (the kernel reaps what the run killed last)
    assert not _alive(children), f"left running: {_alive(children)}"
    assert not (run_dir / "summary.json").exists()

    _resume(run_dir, step)


def _resume(run_dir: Path, step: int) -> None:
    """``--resume`` continues the stopped run from checkpoint ``step`` and finishes it (the ledger of
    what it trained checked). It finishes three steps on (``--max-steps``, which a resumed run may
    change): the answers in flight at the stop are trained by then (eta 2), and the rest of the 30
    steps would only repeat what those steps check."""
    until = step + 3
    cmd = [sys.executable, "-m", "flows.cli", "train", CONFIG, "--no-prefect", "--no-progress", "--run-dir"]
    cmd += [str(run_dir), "--max-steps", str(until), "--set", f"storage.checkpoint_every={EVERY}", "--resume"]
    resumed = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from checkpoint v{step}" in resumed.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] == step and summary["steps"] == until
    assert summary["ledger_check"]["ok"], summary["ledger_check"]


@pytest.mark.slow
@pytest.mark.nightly
def test_a_second_ctrl_c_exits_at_once(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    proc = _start(run_dir, out, "--no-progress")
    try:
        _wait_for(run_dir / "checkpoints" / f"v{EVERY}" / "manifest.json", proc, 300)
        children = _descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.2)  # (two signals at once would be delivered as one)
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        rc = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.read_text()
    assert rc == 130 and took < 2, (rc, took, text[-2000:])
    assert "interrupted again: exiting now" in text and "stopped at step" not in text, text[-2000:]
    deadline = time.monotonic() + 15  # what it started sees its parent gone, and exits
    while _alive(children) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(children), f"left running: {_alive(children)}"


def _prefect_servers(procs: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs if "prefect server start" in " ".join(p.cmdline())]


def _interrupted(proc: subprocess.Popen, timeout_s: float, sig: int = signal.SIGINT) -> tuple[int, float]:
    """Ctrl-C to the command's group (``sig``: SIGTERM to the command alone, as ``kill`` sends it):
    its exit status and how long it took to exit."""
    t0 = time.monotonic()
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout_s), time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_ctrl_c_in_a_prefect_run_stops_at_a_checkpoint_while_the_commands_server_records_it(tmp_path):
    """`areal-flow train` in its default mode reports to a Prefect server of the command's own. Ctrl-C
    reaches the run but not that server, which leads a session of its own and stays up until the
    run has reported that it stopped; then it goes too. (Prefect's own temporary server was in the
    command's group: Ctrl-C stopped it first, the train task was retried against it, and the
    command hung for minutes.)"""
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    proc = _start(run_dir, out, "--no-progress", prefect=True)
    try:
        _wait_for(run_dir / "checkpoints" / f"v{EVERY}" / "manifest.json", proc, 300)
        children = _descendants(proc.pid)
        (server,) = _prefect_servers(children)
        assert os.getpgid(server.pid) == server.pid != os.getpgid(proc.pid)
    finally:
        rc, took = _interrupted(proc, 60)
    text = out.read_text()
    assert rc == 130 and took < 30, (rc, took, text[-3000:])
    stopped = [ln for ln in text.splitlines() if ln.startswith("stopped at step ")]
    assert stopped and stopped[0].endswith("--resume"), text[-3000:]
    assert "Cancelled('stopped at step" in text  # recorded: the server was up when the run said it stopped
    assert "Retry" not in text and "ConnectError" not in text and "View at" not in text, text[-3000:]
    time.sleep(1)
    assert not _alive(children), f"left running: {_alive(children)}"


@pytest.mark.slow
@pytest.mark.nightly
@pytest.mark.parametrize("prefect", [True, False], ids=["prefect", "no-prefect"])
def test_sigterm_interrupts_a_run_that_then_continues_from_its_latest_checkpoint(tmp_path, prefect):
    """SIGTERM to the command alone (``kill``, ``timeout``): no checkpoint of the step it was on, but
    the same exit as a Ctrl-C's (130, the one line on how to continue, nothing left running; in
    Prefect mode after Prefect has recorded the runs Crashed), and ``--resume`` continues from the
    latest checkpoint. (It exited -15 with no such line, in Prefect mode after its crash report.)"""
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    proc = _start(run_dir, out, "--no-progress", prefect=prefect)
    try:
        _wait_for(run_dir / "checkpoints" / f"v{EVERY}" / "manifest.json", proc, 300)
        children = _descendants(proc.pid)
    finally:
        rc, took = _interrupted(proc, 60, signal.SIGTERM)
    text = out.read_text()
    assert rc == 130 and took < 30, (rc, took, text[-3000:])
    assert "Traceback" not in text, text[-3000:]
    (stopped,) = [ln for ln in text.splitlines() if ln.startswith("stopped at step ")]
    step = int(stopped.split()[3].rstrip(";"))
    assert stopped.endswith("--resume") and step >= EVERY and (run_dir / "checkpoints" / f"v{step}").is_dir()
    if prefect:
        assert "Crashed('Execution was aborted by a termination signal.')" in text
    time.sleep(1)
    assert not _alive(children), f"left running: {_alive(children)}"
    _resume(run_dir, step)


@pytest.mark.slow
@pytest.mark.nightly
def test_ctrl_c_stops_a_campaign_and_the_same_command_continues_it(tmp_path):
    out_dir, out = tmp_path / "campaign", tmp_path / "out.txt"
    cmd = [sys.executable, "-m", "flows.cli", "campaign", CONFIG, "--out", str(out_dir), "--eta", "0,4"]
    cmd += ["--max-steps", "12", "--set", f"storage.checkpoint_every={EVERY}"]
    proc = _in_own_group(cmd, out)
    try:
        deadline = time.monotonic() + 300
        while not list(out_dir.glob(f"*/checkpoints/v{EVERY}/manifest.json")):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.1)
        children = _descendants(proc.pid)
        assert len(_prefect_servers(children)) == 1
    finally:
        rc, took = _interrupted(proc, 60)
    text = out.read_text()
    assert rc == 130 and took < 30, (rc, took, text[-3000:])
    assert f"stopped; the same command with --out {out_dir} continues the campaign" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    time.sleep(1)
    assert not _alive(children), f"left running: {_alive(children)}"
    (stopped,) = [p.parents[2].name for p in out_dir.glob(f"*/checkpoints/v{EVERY}/manifest.json")]

    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "continued from its checkpoint" in again.stdout + again.stderr
    decision = json.loads((out_dir / "decision.json").read_text())
    assert {s["label"] for s in decision["settings"]} == {"eta0", "eta4"}
    assert json.loads((out_dir / stopped / "summary.json").read_text())["resumed_from_step"] >= EVERY
