"""Dask preload for the reward service's own cluster: a scheduler or nanny that outlives the
process that started it (a trainer killed with SIGKILL) exits within a second.

Loaded by module name (``preload`` / ``preload_nanny``); a nanny's worker is its
multiprocessing child and already exits with it.
"""

from __future__ import annotations

import os
import threading
import time

POLL_S = 0.5


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    os._exit(0)  # re-parented: whoever started us is gone, and nobody will stop us


def dask_setup(_server) -> None:
    threading.Thread(target=_watch, args=(os.getppid(),), name="parent-watch", daemon=True).start()
