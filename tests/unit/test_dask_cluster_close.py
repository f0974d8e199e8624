"""The reward cluster's subprocess scheduler and workers close when their process, or a child of it, is
gone already (distributed's close checks the process's return code, then scans its children, and a
process that exits in between made that scan raise psutil.NoSuchProcess and failed a finished run),
and close a process with everything of its group at once (distributed kills the children first, one
by one: a nanny that outlived its resource tracker printed tracebacks into an interrupted run's output)."""

import asyncio
import sys
import time

import psutil
import pytest
from distributed.core import Status
from distributed.deploy import subprocess as dask_subprocess

from areal_core.reward.dask_cluster import _subprocess_classes


class _Gone:
    def __init__(self, pid):
        raise psutil.NoSuchProcess(pid)


@pytest.mark.parametrize("program", ["import time; time.sleep(60)", "pass"], ids=["child-gone", "process-gone"])
def test_close_finishes_when_the_scan_finds_no_process(program, monkeypatch):
    scheduler_cls, worker_cls = _subprocess_classes()
    monkeypatch.setattr(dask_subprocess.psutil, "Process", _Gone)

    async def close_one(cls, *args):
        node = cls(*args, env={})
        node.process = proc = await asyncio.create_subprocess_exec(sys.executable, "-c", program)
        node.status = Status.running
        await asyncio.wait_for(node.close(), 30)
        return node, proc

    for cls, args in ((scheduler_cls, ()), (worker_cls, ("tls://127.0.0.1:1",))):
        node, proc = asyncio.run(close_one(cls, *args))
        assert node.process is None and node.status == Status.closed
        assert proc.returncode is not None  # killed (the sleeping one) or exited; reaped either way
        assert not psutil.pid_exists(proc.pid)


def test_without_the_fix_the_scan_raises(monkeypatch):
    """The reference: distributed's own close raises in the same situation (what the override catches)."""
    monkeypatch.setattr(dask_subprocess.psutil, "Process", _Gone)

    async def close_plain():
        node = dask_subprocess.SubprocessScheduler()
        node.process = proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
        try:
            await node.close()
        finally:
            proc.kill()
            await proc.wait()

    with pytest.raises(psutil.NoSuchProcess):
        asyncio.run(close_plain())


def test_a_closed_cluster_leaves_nothing_in_the_temporary_folder(tmp_path, monkeypatch):
    """Its certificates and the scheduler's address file live in one private folder, removed on close
    (distributed's subprocess scheduler would otherwise leave a file in /tmp per cluster)."""
    import tempfile

    from distributed import Client

    from areal_core.reward.dask_cluster import RewardCluster

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cluster = RewardCluster(1, 1, scheduler_kwargs={}, worker_kwargs={})
    try:
        (folder,) = tmp_path.iterdir()
        assert folder.name.startswith("areal-dask-tls-") and (folder / "scheduler.json").is_file()
        with Client(cluster.address, security=cluster.security, timeout=60) as client:
            assert client.submit(sum, [1, 2]).result(timeout=60) == 3
    finally:
        cluster.close()
    assert list(tmp_path.iterdir()) == []


# A process of the cluster as the close finds it: it leads a group (a session of its own) in which it
# started children (a nanny's worker and resource tracker), and a process in a session of its own (a
# grader's helper). It waits for its first child and, should it outlive it, says so in a file (a nanny
# that saw its resource tracker die started another and printed tracebacks into the run's output).
# Forty more children make killing them one at a time slow enough for it to notice nearly always.
LEADER = """
import os, subprocess, sys
first = subprocess.Popen(["sleep", "600"])
rest = [subprocess.Popen(["sleep", "600"]) for _ in range(40)]
apart = subprocess.Popen(["sleep", "600"], start_new_session=True)
print(" ".join(str(p.pid) for p in [first, *rest, apart]), flush=True)
os.waitpid(first.pid, 0)
with open(sys.argv[1], "w") as f:
    f.write("outlived a child")
"""


async def _close_a_leader(node, flag) -> list[int]:
    """Start LEADER as ``node``'s process, close ``node``; the pids of what the leader started."""
    node.process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", LEADER, str(flag), stdout=asyncio.subprocess.PIPE, start_new_session=True
    )
    started = [int(p) for p in (await node.process.stdout.readline()).split()]
    node.status = Status.running
    await asyncio.wait_for(node.close(), 30)
    return started


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_close_kills_the_process_group_at_once_and_what_it_started_elsewhere(tmp_path):
    scheduler_cls, worker_cls = _subprocess_classes()
    for i, (cls, args) in enumerate([(scheduler_cls, ())] * 3 + [(worker_cls, ("tls://127.0.0.1:1",))] * 3):
        node, flag = cls(*args, env={}), tmp_path / f"round{i}"
        started = asyncio.run(_close_a_leader(node, flag))
        assert node.process is None and node.status == Status.closed
        assert not flag.exists(), f"round {i}: the process ran on after a child of its group was killed"
        deadline = time.monotonic() + 10  # (the sleeps are reaped by init once their parent is gone)
        while not all(map(_gone, started)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in started if not _gone(p)] == []  # the one in a session of its own too


def test_without_the_fix_the_process_outlives_its_children(tmp_path):
    """The reference: distributed's close kills the children one by one, then the process, which sees
    a child die first (in one of ten rounds at least; nearly every round in practice)."""
    for i in range(10):
        flag = tmp_path / f"round{i}"
        asyncio.run(_close_a_leader(dask_subprocess.SubprocessScheduler(), flag))
        time.sleep(0.2)  # (its last write, if it outlived a child)
        if flag.exists():
            return
    pytest.fail("the process never outlived a child in ten rounds")
