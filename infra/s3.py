"""A local S3 endpoint (moto's standalone server) for tests and local runs.

``MotoS3Server`` starts ``moto_server`` from the same virtual environment as the
running interpreter, bound to 127.0.0.1 on a free port, and waits until it
answers. ``.env()`` gives the environment variables that point s3fs/boto at it
(see ``areal_core.storage.fsutil`` for every variable that is honoured).

moto keeps its state in memory: ``restart()`` loses every bucket. To simulate an
unavailable endpoint without losing state use ``pause()``/``resume()``
(SIGSTOP/SIGCONT): the kernel still accepts connections, so clients see read
timeouts, which is why ``env(fast_timeouts=True)`` sets short timeouts.

Run one by hand::

    python -m infra.s3 --port 9000      # prints the variables to export
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from areal_core.net import free_port
from areal_core.storage.fsutil import ensure_bucket

__all__ = ["MotoS3Server", "ensure_bucket", "free_port"]

DUMMY_KEY = "testing"
DUMMY_SECRET = "testing"


def moto_server_executable() -> str:
    exe = Path(sys.executable).parent / "moto_server"
    if not exe.exists():
        raise FileNotFoundError(f"moto_server not found next to {sys.executable}; install moto[server]")
    return str(exe)


class MotoS3Server:
    """A ``moto_server`` subprocess on 127.0.0.1. Use as a context manager or call stop()."""

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        region: str = "us-east-1",
        start_timeout_s: float = 60.0,
        log_path: str | None = None,
    ):
        self.host = host
        self.port = port or free_port(host)
        self.region = region
        self.start_timeout_s = start_timeout_s
        # an automatic log is removed by stop() unless the server failed to start
        self._own_log = log_path is None
        self.log_path = log_path or os.path.join(tempfile.gettempdir(), f"moto-s3-{os.getpid()}-{self.port}.log")
        self._proc: subprocess.Popen | None = None
        self._paused = False

    # -- lifecycle ---------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> MotoS3Server:
        if self.running():
            return self
        cmd = [moto_server_executable(), "-H", self.host, "-p", str(self.port)]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._paused = False
        try:
            self._wait_ready()
        except BaseException:
            self._own_log = False  # keep the log for the error message
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"moto_server exited with {self._proc.returncode} before answering; see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(self.endpoint_url + "/moto-api/data.json", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"moto_server did not answer on {self.endpoint_url} "
                    f"within {self.start_timeout_s}s; see {self.log_path}"
                )
            time.sleep(0.1)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server by its own PID: SIGTERM, then SIGKILL. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            if self._paused:  # a stopped process would not act on SIGTERM
                os.kill(proc.pid, signal.SIGCONT)
                self._paused = False
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout_s)
        self._proc = None
        if self._own_log and os.path.exists(self.log_path):
            os.unlink(self.log_path)

    def restart(self) -> MotoS3Server:
        """Stop and start again on the same port. moto's state (buckets, objects) is lost."""
        self.stop()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP the server: connections are accepted by the kernel but never answered."""
        if not self.running():
            raise RuntimeError("moto_server is not running")
        os.kill(self._proc.pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        if self.running() and self._paused:
            os.kill(self._proc.pid, signal.SIGCONT)
        self._paused = False

    def __enter__(self) -> MotoS3Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- client configuration ---------------------------------------------
    def env(self, fast_timeouts: bool = False) -> dict[str, str]:
        """Environment variables that point s3fs (and boto3) at this server.

        ``fast_timeouts``: short connect/read timeouts and a single attempt per
        request inside botocore and s3fs, so that an unavailable endpoint shows
        up within about a second and retrying is left to the caller.
        """
        env = {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": DUMMY_KEY,
            "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET,
            "AWS_DEFAULT_REGION": self.region,
        }
        if fast_timeouts:
            env.update(
                {
                    "AWS_MAX_ATTEMPTS": "1",
                    "AREAL_S3_CONNECT_TIMEOUT": "1",
                    "AREAL_S3_READ_TIMEOUT": "1",
                    "AREAL_S3_RETRIES": "1",
                }
            )
        return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run a local moto S3 server on 127.0.0.1")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--bucket", action="append", default=[], help="create this bucket (s3://name or name); may repeat")
    args = ap.parse_args(argv)
    server = MotoS3Server(port=args.port)
    stop_requested = []

    def _on_signal(signum, frame):
        stop_requested.append(signum)

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    with server:
        env = server.env()
        os.environ.update(env)
        for b in args.bucket:
            ensure_bucket(b if b.startswith("s3://") else f"s3://{b}")
        for k, v in env.items():
            print(f"export {k}={v}")
        print(f"# moto_server pid {server.pid}; Ctrl-C to stop", flush=True)
        while not stop_requested and server.running():
            time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
