"""The reward cluster's subprocess scheduler and workers close when their process, or a child of it, is
gone already: distributed's close checks the process's return code, then scans its children, and a
process that exits in between made that scan raise psutil.NoSuchProcess and failed a finished run."""

import asyncio
import sys

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
