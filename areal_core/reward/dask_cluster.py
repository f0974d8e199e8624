"""The Dask cluster a run starts for its rewards, and how a run reaches an external one: over TLS
with certificates, so a process without the run's certificate cannot connect (and could otherwise
``Client(address).run_on_scheduler(...)`` code as the run's user).

* A local cluster (``local_cluster``): the scheduler and each worker's nanny in processes of their
  own, each in a session of its own (a terminal's Ctrl-C reaches the run alone), all on 127.0.0.1,
  listening on ``tls://`` only, with mutual TLS: every connection, both ways, shows a certificate
  signed by a CA made for this cluster (``Security.temporary``: a fresh key and self-signed
  certificate, which the ``cryptography`` package makes). The certificate and key reach the
  scheduler and nannies as files in a private folder (``mkdtemp``: mode 0700; the files 0600),
  named in their environment (dask's ``DASK_DISTRIBUTED__COMM__TLS__*``; the files, not their
  contents, and nothing in argv); the folder is removed when the cluster closes. This process
  keeps the certificate in memory (``RewardCluster.security``).
* An external scheduler (``reward.scheduler_address``): ``tls://`` with ``reward.tls_ca_file``,
  ``tls_client_cert`` and ``tls_client_key`` (``external_security``); a ``tcp://`` address works
  but is logged as unauthenticated.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import shutil
import signal
import sys
import tempfile

log = logging.getLogger(__name__)

_SPAWN_ENV: contextvars.ContextVar[dict | None] = contextvars.ContextVar("areal_dask_spawn_env", default=None)


class _OwnSessions:
    """``asyncio`` as ``distributed.deploy.subprocess`` sees it: its subprocesses (the scheduler and
    each worker's nanny) start in sessions of their own, with the environment the task starting them
    set (``_SPAWN_ENV``: where the cluster's certificate lies)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    async def create_subprocess_exec(self, *args, **kwargs):
        env = _SPAWN_ENV.get()
        if env is not None:
            kwargs["env"] = {**os.environ, **env}
        if args[:2] == (sys.executable, "-m"):  # isolated (-I): no module of the run's folder or PYTHONPATH is
            # imported in place of a standard one; the nanny's worker processes inherit the flag
            args = (sys.executable, "-I", *args[1:])
        return await self._real.create_subprocess_exec(*args, start_new_session=True, **kwargs)


def _subprocess_classes():
    """Dask's subprocess scheduler and worker, started with the cluster's TLS environment."""
    from distributed.deploy import subprocess as dask_subprocess

    if not isinstance(dask_subprocess.asyncio, _OwnSessions):
        dask_subprocess.asyncio = _OwnSessions(dask_subprocess.asyncio)

    class SpawnsWithEnv:
        """Starts its process with ``self._env`` added to the environment (set by the subclass)."""

        _env: dict

        async def _start(self):
            token = _SPAWN_ENV.set(self._env)
            try:
                await super()._start()
            finally:
                _SPAWN_ENV.reset(token)

        async def close(self):
            """Dask's close (kill the process and everything it started, then mark it closed), with
            the process's group killed in one signal (``kill_tree``). Dask kills the children one at a
            time, then the process: a nanny shutting down meanwhile saw its resource tracker killed,
            started another and printed tracebacks into the run's output; and a process that had
            exited (the scheduler stops when the closing cluster tells it to) failed the close."""
            if self.process is not None and self.process.returncode is None:
                kill_tree(self.process.pid)
                await self.process.communicate()
            self.process = None
            await super(dask_subprocess.Subprocess, self).close()

    class Scheduler(SpawnsWithEnv, dask_subprocess.SubprocessScheduler):
        def __init__(self, env: dict, **kwargs):
            self._env = env
            super().__init__(**kwargs)

    class Worker(SpawnsWithEnv, dask_subprocess.SubprocessWorker):
        def __init__(self, scheduler: str, env: dict, **kwargs):
            self._env = env
            super().__init__(scheduler, **kwargs)

    return Scheduler, Worker


def kill_tree(pid: int) -> None:
    """SIGKILL process ``pid`` and every process it started: its process group (it leads one: it was
    started in a session of its own) in one signal, so none of them runs on after another was
    killed; then its descendants in other groups. Gone processes are skipped."""
    import psutil

    try:
        elsewhere = [p for p in psutil.Process(pid).children(recursive=True) if _group(p) != pid]
    except psutil.NoSuchProcess:
        elsewhere = []
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    for p in elsewhere:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def _group(p) -> int | None:
    """The process group of psutil process ``p``; None once it is gone."""
    try:
        return os.getpgid(p.pid)
    except ProcessLookupError:
        return None


def _write_certificates(security, folder: str) -> dict[str, str]:
    """The ``Security.temporary`` CA, certificate and key as files of mode 0600 in ``folder``, and the
    dask settings (as environment variables) that make a process use them, TLS required."""
    files = {}
    for name, text in (
        ("ca.pem", security.tls_ca_file),
        ("cert.pem", security.tls_scheduler_cert),
        ("key.pem", security.tls_scheduler_key),
    ):
        path = os.path.join(folder, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        files[name] = path
    env = {
        "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True",
        "DASK_DISTRIBUTED__COMM__DEFAULT_SCHEME": "tls",
        "DASK_DISTRIBUTED__COMM__TLS__CA_FILE": files["ca.pem"],
    }
    for role in ("SCHEDULER", "WORKER", "CLIENT"):  # one certificate for every role: the cluster's
        env[f"DASK_DISTRIBUTED__COMM__TLS__{role}__CERT"] = files["cert.pem"]
        env[f"DASK_DISTRIBUTED__COMM__TLS__{role}__KEY"] = files["key.pem"]
    return env


class RewardCluster:
    """A local TLS cluster (see the module docstring): ``address`` (``tls://127.0.0.1:PORT``),
    ``security`` (what a client of it needs), ``cluster`` (the dask ``SpecCluster``); ``close()``."""

    def __init__(
        self,
        n_workers: int,
        threads_per_worker: int,
        *,
        scheduler_kwargs: dict,
        worker_kwargs: dict,
        silence_logs: int = logging.ERROR,
    ):
        from distributed import Security
        from distributed.deploy.spec import SpecCluster
        from distributed.worker_memory import parse_memory_limit

        self.security = Security.temporary()  # (needs the cryptography package)
        self._folder = tempfile.mkdtemp(prefix="areal-dask-tls-")  # mode 0700
        try:
            env = self._env = _write_certificates(self.security, self._folder)
            Scheduler, Worker = _subprocess_classes()
            scheduler_kwargs = {
                "host": "127.0.0.1",
                "port": 0,
                "protocol": "tls",
                "dashboard": False,
                "dashboard_address": None,
                # where the scheduler says its address (distributed's default is a file in /tmp it never removes)
                "scheduler_file": os.path.join(self._folder, "scheduler.json"),
                **scheduler_kwargs,
            }
            worker_kwargs = {
                "host": "127.0.0.1",
                "protocol": "tls",
                "nthreads": threads_per_worker,
                "silence_logs": silence_logs,
                "memory_limit": parse_memory_limit("auto", 1, n_workers, logger=log),
                **worker_kwargs,
            }
            worker = {
                "cls": Worker,
                "options": {"env": env, "worker_class": "distributed.Nanny", "worker_kwargs": worker_kwargs},
            }
            self.cluster = SpecCluster(
                workers=dict.fromkeys(range(n_workers), worker),
                worker=worker,
                scheduler={"cls": Scheduler, "options": {"env": env, "scheduler_kwargs": scheduler_kwargs}},
                security=self.security,
                name="RewardCluster",
                silence_logs=silence_logs,
            )
        except BaseException:
            shutil.rmtree(self._folder, ignore_errors=True)
            raise

    @property
    def address(self) -> str:
        return self.cluster.scheduler_address

    def client_settings(self) -> dict[str, str]:
        """The ``reward.*`` settings with which another process reaches this cluster (its address and
        certificate files; they exist until ``close()``)."""
        tls = "DASK_DISTRIBUTED__COMM__TLS__"  # the files its own processes are given (_write_certificates)
        return {
            "scheduler_address": self.address,
            "tls_ca_file": self._env[f"{tls}CA_FILE"],
            "tls_client_cert": self._env[f"{tls}CLIENT__CERT"],
            "tls_client_key": self._env[f"{tls}CLIENT__KEY"],
        }

    def close(self) -> None:
        try:
            self.cluster.close()
        finally:
            shutil.rmtree(self._folder, ignore_errors=True)


def external_security(cfg):
    """What a client of ``reward.scheduler_address`` needs: a ``Security`` for ``tls://`` (from the
    configured certificate files), None for ``tcp://`` (logged: anyone who reaches it can run code)."""
    from distributed import Security

    address = cfg.scheduler_address
    if address.startswith("tls://"):
        return Security(
            tls_ca_file=cfg.tls_ca_file,
            tls_client_cert=cfg.tls_client_cert,
            tls_client_key=cfg.tls_client_key,
            require_encryption=True,
        )
    log.warning(
        "reward.scheduler_address %s is not tls://: any process that reaches it can run code on the "
        "cluster; use tls:// with reward.tls_ca_file, tls_client_cert and tls_client_key",
        address,
    )
    return None
