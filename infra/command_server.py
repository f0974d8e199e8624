"""The Prefect server a command's flow runs report to: the user's (``PREFECT_API_URL``, e.g. from
``areal-flow stack up``), else one of the command's own, which leads a session of its own.

Left to itself, Prefect starts a temporary server as a child in the command's process group. A
Ctrl-C in the terminal signals that whole group, so the server stopped at once while the run it
followed was still stopping at a checkpoint: the run's last reports failed, Prefect retried the
train task against the dead server, then its connections, for minutes. The command's own server is
out of the terminal's reach: it stays up until the command has reported how its runs ended, and is
stopped when the command leaves the block (on Linux the kernel also stops it should the command die
first: ``PR_SET_PDEATHSIG``). It keeps Prefect's default database (``PREFECT_HOME``), as Prefect's
temporary server does, and runs no UI, scheduler or late-run service: the UI is ``stack up``'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from areal_core.net import free_port
from infra.stack import StackError, prefect_exe, stop_group, wait_healthy

START_TIMEOUT_S = 120.0  # a busy 2-core machine can take a minute to start it
# Linux's prctl, looked up here: the server's process only calls it between fork and exec
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


@contextlib.contextmanager
def prefect_api() -> Iterator[str]:
    """Inside the block this process's flow runs report to the user's Prefect server, or to a
    temporary one of its own (the module's docstring); yields the API's URL."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        yield PREFECT_API_URL.value()
        return
    with _own_server() as url, reporting_to(url, ui=False):
        yield url


@contextlib.contextmanager
def reporting_to(url: str, ui: bool = True) -> Iterator[None]:
    """Talk to the Prefect API at ``url`` inside the block (``ui``: whether its server has a UI for
    Prefect to link flow runs to). On leaving it, the flow logs and events that Prefect's background
    workers still hold are sent while that server is up: left queued, they would be retried against a
    stopped server when the process exits, which then never ends."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url, **({} if ui else {PREFECT_UI_URL: ""})}):
        try:
            yield
        finally:
            APILogWorker.drain_all(timeout=30)
            EventsWorker.drain_all(timeout=30)


@contextlib.contextmanager
def _own_server() -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    cmd = [prefect_exe(), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--no-ui", "--no-scheduler", "--no-late-runs"]
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
            start_new_session=True,
            # only a C call runs between fork and exec, so the threads this process may have are no risk
            preexec_fn=_stopped_with_parent if _PRCTL is not None else None,  # noqa: PLW1509
        )
        try:
            try:
                wait_healthy(url, server, START_TIMEOUT_S)
            except StackError as e:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-2000:]
                raise StackError(f"the command's Prefect server did not start: {e}\n{tail}") from None
            yield url
        finally:
            stop_group(server.pid, signal.SIGINT, 30.0, log=logging.getLogger(__name__).warning, role="Prefect server")
            server.wait()


def _stopped_with_parent() -> None:
    """In the server's process before it runs: SIGTERM it when the thread that started it ends."""
    _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
