"""Start and stop embedded rollout servers as child processes.

Each server runs in its own session (process group), so ``stop()`` can signal
it as a group (:class:`~areal_core.rollout.process.ServerProcess`); it is also
told our PID and exits on its own if we die. Every started server is stopped at
interpreter exit if nobody stopped it before.

Server ``k`` of :class:`EmbeddedServers` samples with its own seed,
``server_seed(run_seed, k)``, so servers given the same prompt answer differently
and a run with the same seed starts each server's random stream the same way.

Every server gets an API key (``auth.py``) in its environment, never in its argv: the run's
(``api_key``), else one made for it. This process remembers it (``auth.KEYRING``), so its clients
send it without being told.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from areal_core.device import resolve_device
from areal_core.net import free_port
from areal_core.rollout import auth
from areal_core.rollout.backends.embedded.client import EmbeddedClient
from areal_core.rollout.client import check_health_sync
from areal_core.rollout.config import EngineConfig
from areal_core.rollout.process import ServerProcess

log = logging.getLogger(__name__)

_REPO_ROOT = str(Path(__file__).resolve().parents[2])


def server_seed(run_seed: int, index: int) -> int:
    """The sampling seed of embedded server ``index`` of a run seeded ``run_seed``: a stable
    hash (the same in every process and Python version), in [0, 2**63)."""
    digest = hashlib.blake2b(f"{run_seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _command(model_path: str, port: int, weight_version: int, engine: EngineConfig) -> list[str]:
    return [
        sys.executable,
        "-m",
        "areal_core.rollout.backends.embedded.server",
        "--model-path",
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--weight-version",
        str(weight_version),
        "--parent-pid",
        str(os.getpid()),
        "--engine-config",
        engine.model_dump_json(),
    ]


def start_server(
    model_path: str,
    *,
    engine: EngineConfig | None = None,
    port: int | None = None,
    weight_version: int = 0,
    log_path: str | None = None,
    env: dict[str, str] | None = None,
    startup_timeout_s: float = 120.0,
    api_key: str | None = None,
    **engine_fields,
) -> ServerProcess:
    """Start a rollout server on 127.0.0.1 and return once ``/health`` answers.
    ``engine``: the engine's settings (sent whole); or give its fields (``max_running=16``, ...).
    ``api_key``: the key it requires (in its environment; None: a new one), remembered for this
    process's clients (``auth.KEYRING``).

    ``port=None`` picks a free port (retrying with another one if it was taken
    meanwhile). Raises ``RuntimeError`` with the log tail if the server exits
    during startup, ``TimeoutError`` if it is not healthy in time.
    """
    engine = engine or EngineConfig(**engine_fields)
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="rollout-server-", suffix=".log")
        os.close(fd)
    child_env = dict(os.environ)
    child_env.update({"OMP_NUM_THREADS": str(engine.torch_threads), "PYTHONUNBUFFERED": "1"})
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, child_env.get("PYTHONPATH")) if p)
    child_env.update(env or {})
    api_key = api_key or auth.new_key()
    child_env[auth.API_KEY_ENV] = api_key
    attempts = 1 if port is not None else 3
    for attempt in range(attempts):
        p = port if port is not None else free_port()
        cmd = _command(model_path, p, weight_version, engine)
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
            )
        server = ServerProcess(proc, "127.0.0.1", p, log_path, api_key)
        auth.remember(server.url, api_key)
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if not server.alive():
                server.stop()
                tail = server.log_tail()
                if "address already in use" in tail.lower() and attempt + 1 < attempts:
                    break  # someone took the port meanwhile: try another one
                raise RuntimeError(
                    f"rollout server for {model_path} exited with code {server.returncode} during startup; "
                    f"log {log_path}:\n{tail}"
                )
            if check_health_sync(server.url, timeout_s=2.0):
                log.info("rollout server %s up (pid %d, log %s)", server.url, server.pid, log_path)
                return server
            if time.monotonic() > deadline:
                server.stop()
                raise TimeoutError(
                    f"rollout server for {model_path} not healthy after {startup_timeout_s:.0f}s; "
                    f"log {log_path}:\n{server.log_tail()}"
                )
            time.sleep(0.2)
    raise RuntimeError("unreachable")  # the loop returns or raises


class EmbeddedServers:
    """``n`` embedded servers started together; one that died can be restarted on its port.

    Server ``k`` runs ``engine`` with the sampling seed ``server_seed(seed, k)`` (``seed``: the run's).
    Every server (a restarted one too) requires ``api_key`` (None: one made for these servers).
    ``restart(i, model_path, version)`` stops server ``i`` (if anything is left of it)
    and starts a new one on the same port with the given weights and the same seed, so
    its URL and the clients that use it stay valid. Use as a context manager: every
    server is stopped by its PID on exit.
    """

    def __init__(
        self,
        model_path: str,
        n: int,
        *,
        engine: EngineConfig | None = None,
        weight_version: int = 0,
        seed: int = 0,
        log_paths: list[str] | None = None,
        startup_timeout_s: float = 120.0,
        api_key: str | None = None,
    ):
        self._engine = engine or EngineConfig()
        self.api_key = api_key or auth.new_key()
        self._timeout = startup_timeout_s
        self._seed = seed
        self._logs = log_paths or [None] * n
        self.servers: list[ServerProcess] = []
        self.restarts = 0
        self._closed = False
        try:
            for k in range(n):
                self.servers.append(
                    start_server(
                        model_path,
                        engine=self._engine_of(k),
                        weight_version=weight_version,
                        log_path=self._logs[k],
                        startup_timeout_s=self._timeout,
                        api_key=self.api_key,
                    )
                )
        except BaseException:
            self.stop()
            raise

    def _engine_of(self, k: int) -> EngineConfig:
        return self._engine.model_copy(update={"seed": server_seed(self._seed, k)})

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def restart(self, i: int, model_path: str, version: int) -> None:
        old = self.servers[i]
        log.warning(
            "restarting rollout server %s (pid %d, alive=%s) with version %d", old.url, old.pid, old.alive(), version
        )
        old.stop()
        new = start_server(
            model_path,
            engine=self._engine_of(i),
            port=old.port,
            weight_version=version,
            log_path=self._logs[i],
            startup_timeout_s=self._timeout,
            api_key=self.api_key,
        )
        self.servers[i] = new
        self.restarts += 1
        if self._closed:  # stopped while this one was starting (a restart runs in a worker thread)
            new.stop()

    def stop(self) -> None:
        self._closed = True
        for s in self.servers:
            s.stop()

    def __enter__(self) -> EmbeddedServers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class EmbeddedBackend:
    """The embedded engine as a rollout backend: ``n_servers`` child processes on this host, each
    requiring ``api_key`` (the run's; None: one made here)."""

    name = "embedded"
    restartable = True
    reads_store_urls = False

    def __init__(self, n_servers: int, engine: EngineConfig, *, log_dir: str | os.PathLike, api_key: str | None = None):
        resolve_device(engine.device)  # a GPU asked for and missing: an error now, not in each server
        self._n, self._engine, self._log_dir = n_servers, engine, Path(log_dir)
        self.api_key = api_key or auth.new_key()
        self._servers: EmbeddedServers | None = None

    @contextlib.contextmanager
    def launch(self, model_path: str, version: int):
        with EmbeddedServers(
            model_path,
            self._n,
            engine=self._engine,
            weight_version=version,
            seed=self._engine.seed,
            log_paths=[str(self._log_dir / f"rollout_server_{k}.log") for k in range(self._n)],
            api_key=self.api_key,
        ) as servers:
            self._servers = servers
            try:
                yield servers.urls
            finally:
                self._servers = None

    def restart(self, index: int, model_path: str, version: int) -> None:
        if self._servers is None:
            raise RuntimeError("restart() outside launch(): no embedded servers are running")
        self._servers.restart(index, model_path, version)

    def client(self, url: str, timeout_s: float = 600.0) -> EmbeddedClient:
        return EmbeddedClient(url, timeout_s, api_key=self.api_key)
