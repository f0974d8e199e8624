"""``cluster:``, where a run's pools run: on this machine (``{kind: local}``, the default) or as jobs
of a Slurm cluster (``{kind: slurm, ...}``: the rollout servers as a job array, the reward workers as
dask-jobqueue jobs and, with ``areal-flow train --cluster slurm``, the trainer itself). A tagged
union, so another scheduler is one more member."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator

from areal_core.configbase import Section

# sbatch --time: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_TIME = re.compile(r"^(\d+|\d+:\d\d|\d+:\d\d:\d\d|\d+-\d+|\d+-\d+:\d\d|\d+-\d+:\d\d:\d\d)$")
_MEMORY = re.compile(r"^\d+[KMGT]?$")  # sbatch --mem: a number with an optional K, M, G or T


class LocalClusterConfig(Section):
    """Everything on this machine: embedded servers and a local Dask cluster, started by the run."""

    kind: Literal["local"] = "local"


class SlurmPoolConfig(Section):
    """What one Slurm job of a pool asks for (``sbatch`` options; None: the cluster's default)."""

    # --nodes per job; the job's command runs once, on its first node, except the trainer's with a
    # megatron backend of several processes: one rank per task of the job, over all its nodes (srun)
    nodes: int = Field(1, gt=0)
    # --ntasks-per-node; for a megatron trainer of several processes, its ranks per node (default:
    # trainer.backend.processes / nodes)
    tasks_per_node: int = Field(1, gt=0)
    cpus_per_task: int | None = Field(None, gt=0)  # --cpus-per-task; None: the partition's default
    gpus_per_node: int | None = Field(None, ge=0)  # --gpus-per-node; None or 0: no GPU asked for
    memory: str | None = None  # --mem per node, e.g. 16G; None: the partition's default
    # more #SBATCH lines for this pool's jobs alone, without the "#SBATCH" (e.g. "--constraint=a100")
    extra_sbatch: list[str] = Field(default_factory=list)

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: str | None) -> str | None:
        if v is not None and not _MEMORY.match(v):
            raise ValueError("memory: expected a number with an optional K, M, G or T (sbatch --mem), e.g. 16G")
        return v

    @field_validator("extra_sbatch")
    @classmethod
    def _options(cls, v: list[str]) -> list[str]:
        return _sbatch_options(v)


def _sbatch_options(lines: list[str]) -> list[str]:
    for line in lines:
        if not line.startswith("-") or "\n" in line:
            raise ValueError(
                f"extra_sbatch: each line is one sbatch option as it follows '#SBATCH', e.g. "
                f"'--constraint=a100' or '--qos=high', got {line!r}"
            )
    return lines


class SlurmClusterConfig(Section):
    """A Slurm cluster: each pool a Slurm job (docs/how-to/slurm.md). The run's folder (and
    ``storage.url`` if set) must be on storage every node reads: a shared folder or s3://."""

    kind: Literal["slurm"] = "slurm"
    partition: str | None = None  # --partition of every job; None: the cluster's default partition
    account: str | None = None  # --account charged for every job; None: the user's default
    time_limit: str | None = None  # --time of every job (e.g. 24:00:00 or 2-00:00:00); None: the partition's
    # the rollout servers: one job of this shape per rollout.n_servers, as one job array; each runs
    # `areal-flow rollout-server` and announces its URL in rollout.join_from once it serves
    rollout: SlurmPoolConfig = SlurmPoolConfig()
    # the reward workers: reward.n_workers jobs of this shape (dask-jobqueue's SLURMCluster), each one
    # Dask worker with reward.threads_per_worker threads, over the run's TLS
    reward: SlurmPoolConfig = SlurmPoolConfig()
    trainer: SlurmPoolConfig = SlurmPoolConfig()  # the trainer's job (`areal-flow train --cluster slurm`)
    # #SBATCH lines every job of the run gets, without the "#SBATCH" (e.g. "--qos=high")
    extra_sbatch: list[str] = Field(default_factory=list)
    # shell lines each job runs before its command: the environment to activate (e.g. "module load
    # cuda/12.4", "source /shared/areal-flow/.venv/bin/activate"); the command is then the areal-flow
    # (or dask worker) of `python` below
    setup: list[str] = Field(default_factory=list)
    # the Python every job runs (areal-flow's, as every node sees it); None: the one running this process
    python: str | None = None
    # how long a pool may take from submission until it serves (queue wait included), in seconds;
    # past it the run stops with one line naming the job id, its state, node and log file
    start_timeout_s: float = Field(600.0, gt=0)
    # the trainer's address as the pools' nodes reach it (the weight transport's master and the Dask
    # scheduler listen there); None: this host's address on the route to the Slurm controller
    trainer_address: str | None = None
    # requeue a job the cluster preempts or a node failure ends (sbatch --requeue): a rollout server
    # rejoins the pool, the trainer resumes from its last checkpoint
    requeue: bool = True

    @field_validator("time_limit")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None and not _TIME.match(v):
            raise ValueError(
                "time_limit: expected sbatch's --time format: MM, HH:MM:SS, D-HH or D-HH:MM:SS (e.g. 24:00:00)"
            )
        return v

    @field_validator("extra_sbatch")
    @classmethod
    def _options(cls, v: list[str]) -> list[str]:
        return _sbatch_options(v)

    @field_validator("setup")
    @classmethod
    def _lines(cls, v: list[str]) -> list[str]:
        bad = [line for line in v if "\n" in line]
        if bad:
            raise ValueError(f"setup: one shell line per item (no newlines), got {bad[0]!r}")
        return v


ClusterConfig = Annotated[LocalClusterConfig | SlurmClusterConfig, Field(discriminator="kind")]


def settle_rollout(cluster, rollout) -> None:
    """Check ``rollout`` (a RolloutConfig) against ``cluster`` and fill in what a Slurm pool needs
    (called by the whole config's checks): its servers are embedded servers on other nodes, so their
    weights travel by the distributed transport (or disk) and the pool is elastic (a task that ends
    leaves it, a requeued one joins again: ``min_servers`` defaults to 1)."""
    if cluster.kind != "slurm":
        return
    from areal_core.rollout.config import DistributedTransportConfig

    if rollout.backend.kind != "embedded":
        raise ValueError(
            f"cluster: slurm runs the rollout servers as `areal-flow rollout-server` jobs (the embedded "
            f"engine), so rollout.backend.kind must be embedded (got {rollout.backend.kind!r}); servers "
            "started otherwise join through rollout.backend: {kind: external, ...} and cluster: {kind: local}"
        )
    t = rollout.weight_transport
    if t is not None and t.kind == "tensor":
        raise ValueError(
            "rollout.weight_transport kind 'tensor' shares memory on one host; with cluster: slurm the "
            "servers run on other nodes: use {kind: distributed} (the default there) or {kind: disk}"
        )
    if t is None:
        rollout.weight_transport = DistributedTransportConfig()
    if rollout.min_servers is None:
        rollout.min_servers = 1


def settle_trainer(cluster, trainer) -> None:
    """Check a megatron ``trainer`` (a TrainerConfig) of several processes against a Slurm ``cluster``:
    its job runs one rank per task over ``cluster.trainer.nodes`` nodes, so nodes x tasks_per_node
    must make ``trainer.backend.processes`` (tasks_per_node, left unset, is worked out)."""
    b = trainer.backend
    if cluster.kind != "slurm" or b.kind != "megatron" or b.processes == 1:
        return
    job = cluster.trainer
    if "tasks_per_node" not in job.model_fields_set and b.processes % job.nodes == 0:
        job.tasks_per_node = b.processes // job.nodes
    if job.nodes * job.tasks_per_node != b.processes:
        raise ValueError(
            f"cluster.trainer: the megatron trainer's job runs one rank per task, so nodes x tasks_per_node "
            f"({job.nodes} x {job.tasks_per_node}) must equal trainer.backend.processes ({b.processes})"
        )
