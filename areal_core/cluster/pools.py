"""Where a run's setup (``run/setup.py``) asks the cluster for its pools: the rollout backend, the
reward service and the weight transport's settings, on this machine (``cluster: {kind: local}``) or as
Slurm jobs (``{kind: slurm}``)."""

from __future__ import annotations

from pathlib import Path

from areal_core.cluster import slurm
from areal_core.cluster.config import SlurmClusterConfig
from areal_core.cluster.jobs import FOLDER
from areal_core.net import address_towards

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SLURMCTLD_PORT = 6817  # (only the route matters: nothing is sent)


def trainer_address(cluster: SlurmClusterConfig) -> str:
    """The trainer's address as the jobs' nodes reach it: ``cluster.trainer_address``, else this host's
    address on the route to the Slurm controller."""
    return cluster.trainer_address or address_towards(slurm.controller_address(), SLURMCTLD_PORT)


def with_run_folder(cfg, run_dir: str | Path):
    """``cfg`` as a run in ``run_dir`` uses it: on Slurm, ``rollout.join_from`` defaults to
    ``RUN/slurm/rollout-servers.txt`` (where the pool's servers announce themselves)."""
    if cfg.cluster.kind != "slurm" or cfg.rollout.join_from:
        return cfg
    join_from = str(Path(run_dir).resolve() / FOLDER / "rollout-servers.txt")
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"join_from": join_from})})


def rollout_backend(cfg, *, engine, run_dir: str | Path, api_key: str):
    """The backend that starts the run's rollout servers: ``rollout.backend``'s on this machine, or the
    Slurm job array (``cluster: slurm``)."""
    if cfg.cluster.kind != "slurm":
        from areal_core.rollout.backends import make_backend

        return make_backend(cfg.rollout, engine=engine, log_dir=run_dir, api_key=api_key)
    from areal_core.cluster.rollout_pool import SlurmRolloutBackend

    return SlurmRolloutBackend(
        n_servers=cfg.rollout.n_servers,
        cluster=cfg.cluster,
        engine=engine,
        run_dir=str(Path(run_dir).resolve()),
        run_name=cfg.name,
        api_key=api_key,
        join_from=cfg.rollout.join_from,
        trainer_address=trainer_address(cfg.cluster),
        seed=cfg.seed,
    )


def reward_service(cfg, run_dir: str | Path):
    """A context manager giving the run's ``RewardService``: a local Dask cluster (or
    ``reward.scheduler_address``), or reward workers as Slurm jobs (``cluster: slurm``)."""
    if cfg.cluster.kind != "slurm" or cfg.reward.scheduler_address:
        from areal_core.reward.service import RewardService
        from areal_core.startup import made_on_enter

        return made_on_enter(RewardService, cfg.reward)
    from areal_core.cluster.reward_pool import slurm_reward_service

    return slurm_reward_service(
        cfg.reward, cfg.cluster, str(Path(run_dir).resolve()), cfg.name, trainer_address(cfg.cluster)
    )


def weight_transport(cfg, backend):
    """The weight transport's settings: on Slurm the distributed transport's ``master_address`` is the
    trainer's address as the servers' nodes reach it (unless the config names one)."""
    t = cfg.rollout.transport()
    trainer = getattr(backend, "trainer_address", None)
    if trainer and t.kind == "distributed" and t.master_address in LOOPBACK:
        return t.model_copy(update={"master_address": trainer})
    return t
