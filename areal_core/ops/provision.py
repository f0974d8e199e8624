"""Bring up or connect to what a run needs, and verify each part works (no Prefect here).

* Dask: a local cluster (scheduler and workers in their own processes) by default, or the configured ``reward.scheduler_address``;
  verified by grading a known answer on a worker.
* Object storage: a folder, file:// or s3:// URL; the bucket is created if missing,
  then a probe object is written, read back and removed. S3 credentials come from the
  environment (the Prefect flow may fill it from a block first), never from a config.
* Rollout servers: external ones must answer ``/health``; embedded ones are started
  by the training run itself (one process per ``rollout.n_servers``).
* ``cluster: slurm``: the reward workers are brought up as Slurm jobs (dask-jobqueue, over the run's
  TLS), grade the known answer and are cancelled again; the report names their job ids and how long
  they took from submission to grading. The rollout servers are the run's own job array.
"""

from __future__ import annotations

import time
import uuid

from areal_core.experiment import ExperimentConfig
from areal_core.reward.config import RewardConfig
from areal_core.reward.service import RewardService
from areal_core.rollout.client import check_health_sync
from areal_core.rollout.config import RolloutConfig
from areal_core.storage.fsutil import ensure_bucket, filesystem, join, read_bytes, write_bytes_atomic


class ProvisionError(RuntimeError):
    """A part a run needs is not reachable or does not work."""


def check_dask(cfg: RewardConfig, service=None) -> dict:
    """Grade a known answer on the cluster (``service``: a context manager giving the RewardService;
    default: ``RewardService(cfg)``)."""
    t0 = time.perf_counter()
    with service if service is not None else RewardService(cfg) as svc:
        address = svc.scheduler_address
        workers = len(svc.client.scheduler_info().get("workers", {}))
        [ok] = svc.grade_many("chain", ["a1b3|3"], ["a1b3|3"])
    if not ok.correct:
        raise ProvisionError(f"Dask grading check failed on {address}: a correct chain graded wrong")
    return {
        "scheduler": cfg.scheduler_address or "local Dask cluster (started per run)",
        "probe_address": address,
        "workers": workers,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def check_storage(url: str) -> dict:
    """Create the bucket (s3) if needed; write, read back and delete a probe object."""
    if url.startswith(("s3://", "s3a://")):
        ensure_bucket(url)
    probe = join(url, f".provision-probe-{uuid.uuid4().hex[:8]}")
    data = uuid.uuid4().bytes
    write_bytes_atomic(probe, data, retries=2)
    if read_bytes(probe) != data:
        raise ProvisionError(f"storage probe {probe}: read back different bytes")
    fs, path = filesystem(probe)
    fs.rm_file(path)
    return {"url": url, "writable": True}


def check_rollout(cfg: RolloutConfig) -> dict:
    b = cfg.backend
    if b.kind == "embedded" or (b.kind == "sglang" and not b.urls):
        return {"backend": b.kind, "started_by": "the training run"}
    down = [u for u in b.urls if not check_health_sync(u, timeout_s=5.0)]
    if down:
        raise ProvisionError(f"rollout servers ({b.kind}) not healthy: {down}")
    return {"backend": b.kind, "urls": list(b.urls), "healthy": True}


def storage_url(cfg: ExperimentConfig, out_dir: str) -> str:
    """Where the run's checkpoints go: ``storage.url`` or the output folder."""
    return cfg.storage.url or out_dir


def provision(cfg: ExperimentConfig, out_dir: str) -> dict:
    if cfg.cluster.kind == "slurm":
        return _provision_on_slurm(cfg, out_dir)
    return {
        "dask": check_dask(cfg.reward),
        "storage": check_storage(storage_url(cfg, out_dir)),
        "rollout": check_rollout(cfg.rollout),
    }


def _provision_on_slurm(cfg: ExperimentConfig, out_dir: str) -> dict:
    from areal_core.cluster.jobs import RunJobs
    from areal_core.cluster.pools import reward_service, trainer_address

    before = set(RunJobs(out_dir).ids())
    dask = check_dask(cfg.reward, reward_service(cfg, out_dir))
    dask["scheduler"] = "reward workers as Slurm jobs (dask-jobqueue), cancelled after the check"
    dask["slurm_jobs"] = [j for j in RunJobs(out_dir).ids(("reward",)) if j not in before]
    return {
        "dask": dask,
        "storage": check_storage(storage_url(cfg, out_dir)),
        "rollout": {"backend": "slurm", "started_by": "the training run, as a Slurm job array"},
        "slurm": {"trainer_address": trainer_address(cfg.cluster), "jobs_file": str(RunJobs(out_dir).path)},
    }
