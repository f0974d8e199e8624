"""Ranks 1.. of a megatron trainer on this host, started by the run itself (so one
``areal-flow train`` command is enough): the environment torchrun would give them, each its own
process stopped by its PID. Under torchrun (``RANK`` set) nothing is started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from areal_core.net import free_port

_RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def local_ranks(processes: int, tp_size: int, log_dir: str | Path) -> Iterator[list[subprocess.Popen]]:
    """Start followers for ranks ``1..processes-1`` and make this process rank 0 (its environment
    names the rendezvous until the context ends); on exit every follower still running is killed.
    Once the context's body ends normally the followers (released by rank 0) must exit cleanly: one
    that exits otherwise (a crash while it leaves, a kill) is a RuntimeError naming its rank, how it
    ended and its log."""
    if processes == 1 or "RANK" in os.environ:
        yield []
        return
    port = free_port()
    base = {
        "WORLD_SIZE": str(processes),
        "LOCAL_WORLD_SIZE": str(processes),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    procs: list[subprocess.Popen] = []
    saved = {k: os.environ.get(k) for k in _RENDEZVOUS}
    try:
        for rank in range(1, processes):
            env = {
                **os.environ,
                **base,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(
                    p for p in (str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH")) if p
                ),
            }
            with open(Path(log_dir) / f"megatron_rank{rank}.log", "ab") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "areal_core.trainer.megatron.follower",
                            "--tensor-parallel-size",
                            str(tp_size),
                        ],
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )  # Ctrl-C reaches rank 0 alone, which releases them
        os.environ.update({**base, "RANK": "0", "LOCAL_RANK": "0"})
        yield procs
        for p in procs:  # released by MegatronTrainer.close(): they exit on their own
            p.wait(timeout=60)
        failed = [_how_it_ended(rank, p.returncode, log_dir) for rank, p in enumerate(procs, 1) if p.returncode]
        if failed:
            raise RuntimeError("; ".join(failed))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _how_it_ended(rank: int, status: int, log_dir: str | Path) -> str:
    """Why a follower that rank 0 released did not exit cleanly, and where its log is."""
    how = f"was killed by {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"
    return f"megatron rank {rank} {how} (its log: {Path(log_dir) / f'megatron_rank{rank}.log'})"
