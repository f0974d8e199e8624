"""A server child process, for every rollout backend (the embedded engine's launcher, SGLang, vLLM).

A :class:`ServerProcess` leads its own session (process group), so ``stop()`` signals the
server and whatever it started; it is stopped at interpreter exit if nobody stopped it before.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess

log = logging.getLogger(__name__)


def _tail(path: str, n_bytes: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n_bytes))
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no log)"


class ServerProcess:
    """A running rollout server; ``stop()`` (idempotent) or use it as a context manager."""

    def __init__(self, proc: subprocess.Popen, host: str, port: int, log_path: str, api_key: str | None = None):
        self._proc = proc
        self.pid = proc.pid
        self.port = port
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        self.api_key = api_key  # what its clients send (None: a server that takes none)
        atexit.register(self.stop)

    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()

    def log_tail(self, n_bytes: int = 4000) -> str:
        return _tail(self.log_path, n_bytes)

    def _signal(self, sig: int) -> None:
        # the server leads its own session (start_new_session), so its group id is its pid
        try:
            if os.getpgid(self.pid) == self.pid:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server, SIGKILL it after ``grace_s``; returns once it is gone."""
        atexit.unregister(self.stop)
        if self._proc.poll() is None:  # not reaped yet, so the pid is still ours
            self._signal(signal.SIGTERM)
            try:
                self._proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("rollout server %d ignored SIGTERM for %.0fs; killing it", self.pid, grace_s)
                self._signal(signal.SIGKILL)
                self._proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerProcess(url={self.url!r}, pid={self.pid}, alive={self.alive()})"
