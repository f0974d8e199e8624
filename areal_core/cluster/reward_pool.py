"""The reward workers as Slurm jobs: dask-jobqueue's ``SLURMCluster`` with the run's own TLS.

The scheduler runs in the trainer's process (dask-jobqueue's design), listening on the trainer's
address (``cluster.trainer_address``) over ``tls://`` only, with a certificate made for the run
(``Security.temporary``, as the local cluster's). The workers are ``reward.n_workers`` jobs of
``cluster.reward``'s shape, each one Dask worker (under a nanny) of ``reward.threads_per_worker``
threads with the graders preloaded; they find their certificate in a private folder (mode 0700,
files 0600) under the run's ``slurm/`` folder, which every node reads, passed by path on their
command line (dask-jobqueue's ``shared_temp_directory``); the folder is removed when the cluster
closes, which cancels the jobs. A worker whose scheduler is gone for 60 s exits by itself.

The run's :class:`RewardService` reaches the scheduler as it would an external one
(``reward.scheduler_address`` with the ``tls_*`` files), once every worker has connected.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import shlex
import shutil
import signal
import tempfile
import time

from areal_core.cluster import slurm
from areal_core.cluster.config import SlurmClusterConfig
from areal_core.cluster.jobs import RunJobs, folder
from areal_core.cluster.scripts import python
from areal_core.cluster.slurm import PoolNotReady, log_tail
from areal_core.reward.config import RewardConfig
from areal_core.reward.dask_cluster import _write_certificates
from areal_core.reward.service import GRADER_MODULES, RewardService

log = logging.getLogger(__name__)

WORKER_MEMORY = "4GiB"  # a worker's memory limit where cluster.reward.memory is not set (no --mem line then)


def _slurm_cluster_class():
    """dask-jobqueue's ``SLURMCluster``. Importing dask-jobqueue sets a SIGINT handler of its own (its
    ``runner`` module, at import), which would replace the run's Ctrl-C handling in the main thread and
    fails outright in any other (a Prefect task's): the import runs with ``signal.signal`` kept from
    changing anything."""
    real = signal.signal
    signal.signal = lambda signum, handler: signal.getsignal(signum)
    try:
        from dask_jobqueue import SLURMCluster
    except ImportError:
        raise ImportError(
            "cluster: slurm starts the reward workers with dask-jobqueue: pip install 'areal-flow[slurm]'"
        ) from None
    finally:
        signal.signal = real
    return SLURMCluster


def jobqueue_options(
    reward: RewardConfig, cluster: SlurmClusterConfig, run_dir: str, run_name: str, scheduler_host: str
) -> dict:
    """SLURMCluster's settings for the run's reward workers (without the security). Each worker
    listens on its node's address towards ``scheduler_host`` (worked out in the job: Dask's own guess
    is the route to the internet, which a cluster node may not have, and then it listens on loopback)."""
    pool = cluster.reward
    find_host = f"from areal_core.net import address_towards as a; print(a({scheduler_host!r}, 9))"
    host_line = f"AREAL_WORKER_HOST=$({shlex.quote(python(cluster))} -I -c {shlex.quote(find_host)})"
    extra = list(cluster.extra_sbatch) + list(pool.extra_sbatch) + ["--no-requeue"]
    if pool.gpus_per_node:
        extra.append(f"--gpus-per-node={pool.gpus_per_node}")
    return {
        "queue": cluster.partition,
        "account": cluster.account,
        "walltime": cluster.time_limit,
        "cores": reward.threads_per_worker,
        "processes": 1,
        "job_cpu": pool.cpus_per_task or reward.threads_per_worker,
        "memory": WORKER_MEMORY if pool.memory is None else _dask_bytes(pool.memory),
        "job_mem": pool.memory,
        "job_directives_skip": [] if pool.memory else ["--mem"],
        "job_extra_directives": extra,
        "job_script_prologue": [*cluster.setup, host_line],
        "log_directory": str(folder(run_dir)),
        "python": python(cluster),
        "job_name": f"af-{run_name}-reward",
        "death_timeout": 60,
        "worker_extra_args": ["--host", '"$AREAL_WORKER_HOST"', *(w for m in GRADER_MODULES for w in ("--preload", m))],
    }


def _dask_bytes(memory: str) -> str:
    """sbatch's ``--mem`` (MiB by default; K, M, G, T are powers of 1024) as Dask's byte string."""
    return memory + ("MiB" if memory[-1].isdigit() else "iB")


@contextlib.contextmanager
def slurm_reward_service(
    reward: RewardConfig, cluster: SlurmClusterConfig, run_dir: str, run_name: str, trainer_address: str
):
    """The run's :class:`RewardService` over reward workers that are Slurm jobs (see the module docstring)."""
    from distributed import Security

    SLURMCluster = _slurm_cluster_class()
    security = Security.temporary()
    private = tempfile.mkdtemp(prefix="dask-tls-", dir=folder(run_dir))  # mode 0700, on the shared folder
    try:
        _write_certificates(security, private)  # this process's client certificate (ca.pem, cert.pem, key.pem)
        opts = jobqueue_options(reward, cluster, run_dir, run_name, trainer_address)
        jq = SLURMCluster(
            **opts,
            protocol="tls://",
            security=security,
            shared_temp_directory=private,
            scheduler_options={"host": trainer_address, "port": 0, "dashboard": False, "dashboard_address": None},
        )
        try:
            jq.scale(reward.n_workers)
            _wait_workers(
                jq, reward.n_workers, cluster, RunJobs(run_dir), security, opts["log_directory"], opts["job_name"]
            )
            settings = {
                "scheduler_address": jq.scheduler_address,
                "tls_ca_file": f"{private}/ca.pem",
                "tls_client_cert": f"{private}/cert.pem",
                "tls_client_key": f"{private}/key.pem",
            }
            with RewardService(reward.model_copy(update=settings)) as service:
                yield service
        finally:
            jq.close()  # cancels its jobs (scancel by id)
            slurm.cancel_and_wait(RunJobs(run_dir).ids(("reward",)))  # and they are gone when this returns
            # its jobs' objects hold the workers' key files open (deleted when they are collected):
            # collected here, before the folder goes, rather than at exit over a missing folder
            del jq
            gc.collect()
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _job_ids(jq, n: int, deadline: float) -> list[str]:
    """The job ids of the cluster's ``n`` worker jobs, once submitted."""
    while True:
        ids = [w.job_id for w in jq.workers.values() if getattr(w, "job_id", None)]
        if len(ids) >= n:
            return ids
        if time.monotonic() > deadline:
            raise PoolNotReady(f"reward workers: {len(ids)} of {n} Slurm jobs submitted within the deadline")
        time.sleep(0.2)


def _wait_workers(jq, n: int, cluster: SlurmClusterConfig, jobs: RunJobs, security, log_dir: str, job_name: str):
    """Record the worker jobs, then wait until ``n`` workers have connected to the scheduler; PoolNotReady
    naming the jobs not connected (job id, state, node, log) if one ends first or the deadline passes."""
    from distributed import Client

    deadline = time.monotonic() + cluster.start_timeout_s
    ids = _job_ids(jq, n, min(deadline, time.monotonic() + 120))
    logs = {i: f"{log_dir}/{job_name}-{i}.err" for i in ids}
    for i in ids:
        jobs.add(i, "reward", logs[i])
    log.info("reward workers: Slurm job(s) %s", " ".join(ids))
    with Client(jq.scheduler_address, security=security, timeout="30s") as client:
        while True:
            connected = len(client.nthreads())
            if connected >= n:
                return
            states = {i: slurm.job(i) for i in ids}
            ended = [s for s in states.values() if s is not None and s.ended]
            if ended:
                s = ended[0]
                raise PoolNotReady(
                    f"reward worker {s.describe()} ended before connecting; its log: {logs[s.job_id]}"
                    f"{log_tail(logs[s.job_id])}"
                )
            if time.monotonic() > deadline:
                described = "; ".join(
                    f"{s.describe() if s else f'job {i} gone'}, log {logs[i]}" for i, s in states.items()
                )
                raise PoolNotReady(
                    f"reward workers: {connected} of {n} connected after cluster.start_timeout_s "
                    f"({cluster.start_timeout_s:g} s): {described}"
                )
            time.sleep(1.0)
