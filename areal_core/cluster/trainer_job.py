"""The trainer as a Slurm job (``areal-flow train --cluster slurm``, the train flow's ``cluster``).

``run_trainer_job`` writes ``RUN/slurm/trainer.sbatch``, whose job runs ``areal-flow train CONFIG
--run-dir RUN --resume --no-prefect`` on its node (the same config and overrides, ``cluster.kind:
slurm``, so that process submits the rollout and reward pools as jobs of their own), submits it and
follows it here: its state changes and its log, line by line, until it ends. ``--resume`` always: a
fresh run starts fresh, and a job that Slurm requeues (preemption, a node failure) resumes from its
last checkpoint.

* It must start running within ``cluster.start_timeout_s``, else it is cancelled and the error names
  its job id, state (and why it waits) and log file.
* The first Ctrl-C here sends SIGINT to the trainer's process (``scancel --batch --signal=INT``): it
  stops at a checkpoint, as in a terminal, and cancels its pools; a second Ctrl-C (or SIGTERM, e.g.
  a Prefect cancellation) cancels every job of the run at once.
* However it ends, every job the run submitted (``RUN/slurm/jobs.json``) that Slurm still lists is
  cancelled, by job id.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from areal_core.cluster import slurm
from areal_core.cluster.config import SlurmClusterConfig
from areal_core.cluster.jobs import RunJobs, folder
from areal_core.cluster.pools import SLURMCTLD_PORT
from areal_core.cluster.rollout_pool import areal_flow_command
from areal_core.cluster.scripts import batch_script, python, quote, sbatch_options
from areal_core.cluster.slurm import JobInfo, PoolNotReady, log_tail

STOPPED_STATUS = "130:0"  # the trainer stopped at a checkpoint (Ctrl-C, budget, too few servers)


class TrainerJobEnded(RuntimeError):
    """The trainer's job ended without finishing the run; the message says how and what to do."""

    def __init__(self, message: str, stopped: bool):
        super().__init__(message)
        self.stopped = stopped  # at a checkpoint that --resume continues from


def set_args(overrides: dict | None) -> list[str]:
    """``--set KEY=VALUE`` pairs for a dict of dotted overrides (each value as one line of YAML)."""
    out = []
    for key, value in (overrides or {}).items():
        text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("\n...")
        out.append(f"{key}={text}")
    return out


def trainer_command(cluster: SlurmClusterConfig, config_path: str, run_dir: str, sets, max_steps) -> list[str]:
    """What the trainer's job runs: ``areal-flow train`` of the same config and overrides, resumed."""
    words = [areal_flow_command(cluster), "train", str(Path(config_path).resolve()), "--run-dir", run_dir]
    words += ["--resume", "--no-prefect", "--no-progress"]
    for pair in [*sets, "cluster.kind=slurm"]:
        words += ["--set", pair]
    if max_steps:
        words += ["--max-steps", str(max_steps)]
    return words


def ranks_over_srun(cluster: SlurmClusterConfig, controller: str) -> tuple[list[str], str]:
    """The setup lines and the launcher of a trainer of several processes (megatron's): ``srun`` runs
    one rank per task of the job over its nodes, each with the environment torchrun would give it;
    the rendezvous is the job's first node (rank 0's), at its address on the route to the Slurm
    ``controller``, on a port free there."""
    py = quote([python(cluster), "-I", "-c"])
    find_address = (
        f"from areal_core.net import address_towards as a; print(a({json.dumps(controller)}, {SLURMCTLD_PORT}))"
    )
    find_port = 'from areal_core.net import free_port as f; print(f("0.0.0.0"))'
    setup = [
        f"MASTER_ADDR=$({py} {quote([find_address])})",
        f"MASTER_PORT=$({py} {quote([find_port])})",
        "export MASTER_ADDR MASTER_PORT",
    ]
    rank_env = (
        "export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS "
        f'LOCAL_WORLD_SIZE={cluster.trainer.tasks_per_node}; exec "$@"'
    )
    # not --kill-on-bad-exit: rank 0 stopping at a checkpoint (status 130) must not kill the others
    # while they close; a rank that dies ends the others through their broken gloo connections
    return setup, f"srun --kill-on-bad-exit=0 bash -c {quote([rank_env])} rank"


def trainer_script(
    cluster: SlurmClusterConfig, name: str, command: list[str], run_dir: str, ranks: int = 1, controller: str = ""
) -> str:
    """The trainer's batch script: ``command`` once, or (``ranks`` > 1) once per rank through srun."""
    options = sbatch_options(
        cluster, cluster.trainer, job_name=f"af-{name}-trainer", log=f"{run_dir}/slurm/trainer-%j.log"
    )
    comment = f"areal-flow: the trainer of the run in {run_dir} (requeued: it resumes from its last checkpoint)"
    setup, line = list(cluster.setup), quote(command)
    if ranks > 1:
        rendezvous, launcher = ranks_over_srun(cluster, controller)
        setup, line = setup + rendezvous, f"{launcher} {line}"
        comment += f"\n{ranks} megatron ranks, one per task (rank 0 drives the run, the others follow it)"
    return batch_script(options, setup, line, comment)


class _Follower:
    """A job's state changes and its new log lines, told to ``echo`` as they come."""

    def __init__(self, job_id: str, log: str, requeue: bool, echo: Callable[[str], None]):
        self.job_id, self.log, self.requeue, self.echo = job_id, log, requeue, echo
        self.state: JobInfo | None = None
        self.started = False
        self._pos = 0

    def poll(self) -> JobInfo | None:
        """The job now (None: slurmctld forgot it); echoes what changed."""
        info = slurm.job(self.job_id)
        if info is not None and (self.state is None or (info.state, info.node) != (self.state.state, self.state.node)):
            self.echo(f"trainer: {info.describe()} (log {self.log})")
        self._echo_log()
        if info is not None:
            self.state = info
            self.started = self.started or info.state == "RUNNING"
        return info

    def _echo_log(self) -> None:
        try:
            with open(self.log, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self._pos += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            self.echo(line)

    def final(self, info: JobInfo | None) -> bool:
        """Whether the job is over (a preempted or failed-node job that Slurm requeues is not)."""
        if info is None:
            return True
        return info.ended and not (self.requeue and info.state in ("PREEMPTED", "NODE_FAIL"))

    def until_done(self, start_timeout_s: float) -> JobInfo | None:
        t0 = time.monotonic()
        while True:
            info = self.poll()
            if self.final(info):
                self._echo_log()
                return info if info is not None else self.state
            if not self.started and time.monotonic() - t0 > start_timeout_s:
                raise PoolNotReady(
                    f"trainer {info.describe()} not running after cluster.start_timeout_s ({start_timeout_s:g} s); "
                    f"cancelled; its log: {self.log}"
                )
            time.sleep(1.0)


@contextlib.contextmanager
def _sigterm_exits():
    """SIGTERM (a Prefect cancellation, kill) unwinds this thread as an exit, so the jobs get cancelled."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
        signal.SIG_DFL,
        None,
    ):
        yield
        return

    def exit_now(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_trainer_job(
    cfg, config_path: str, run_dir: str | Path, sets: list[str], max_steps: int | None, echo=print
) -> JobInfo | None:
    """Submit the trainer's job and follow it until it ends (see the module docstring); its last state."""
    cluster: SlurmClusterConfig = cfg.cluster
    run_dir = str(Path(run_dir).resolve())
    where = folder(run_dir)
    path = where / "trainer.sbatch"
    b = cfg.trainer.backend
    ranks = b.processes if b.kind == "megatron" else 1
    command = trainer_command(cluster, config_path, run_dir, sets, max_steps)
    controller = slurm.controller_address() if ranks > 1 else ""
    path.write_text(trainer_script(cluster, cfg.name, command, run_dir, ranks, controller))
    jobs = RunJobs(run_dir)
    job_id = slurm.submit(str(path), env=slurm.environment_for_jobs())
    log = f"{where}/trainer-{job_id}.log"
    jobs.add(job_id, "trainer", log)
    echo(f"trainer: submitted as Slurm job {job_id} ({path})")
    follower = _Follower(job_id, log, cluster.requeue, echo)
    try:
        with _sigterm_exits():
            try:
                return follower.until_done(cluster.start_timeout_s)
            except KeyboardInterrupt:
                if not follower.started:
                    raise
                slurm.signal(job_id, "INT", batch=ranks == 1)  # (the ranks themselves under srun)
                echo(f"trainer: asked job {job_id} to stop at a checkpoint; Ctrl-C again cancels every job of the run")
                return follower.until_done(cluster.start_timeout_s)
    finally:
        left = jobs.cancel()
        if left:
            echo(f"cancelled the run's Slurm job(s) {' '.join(left)}")


def outcome(info: JobInfo | None, run_dir: str | Path, again: str) -> dict:
    """The run's summary once its trainer's job completed; else :class:`TrainerJobEnded` saying how it
    ended (``again``: the command that continues the run, without ``--resume``)."""
    summary = Path(run_dir) / "summary.json"
    if info is not None and info.state == "COMPLETED" and summary.is_file():
        return json.loads(summary.read_text())
    if info is None:
        raise TrainerJobEnded(f"the trainer's job is gone from Slurm and {summary} was not written", stopped=False)
    if info.state == "COMPLETED":
        raise TrainerJobEnded(
            f"trainer {info.describe()} but {summary} was not written; its log: {info.log}{log_tail(info.log)}",
            stopped=False,
        )
    if info.exit_code == STOPPED_STATUS or info.state == "CANCELLED":
        raise TrainerJobEnded(
            f"trainer {info.describe()}: stopped; continue with {again} --resume (its log: {info.log})", stopped=True
        )
    raise TrainerJobEnded(f"trainer {info.describe()}; its log: {info.log}{log_tail(info.log)}", stopped=False)


@contextlib.contextmanager
def pools_cancelled_at_exit(cfg, run_dir: str | Path):
    """Around a run whose pools are Slurm jobs (``cluster: slurm``): however it ends, the rollout and
    reward jobs it submitted that Slurm still lists are cancelled (so are those a previous trainer of
    the run left, before it starts: one killed outright). SIGTERM (Slurm stopping or requeueing the
    trainer's job) ends it through here when it unwinds the run: the train command's
    ``interrupt.sigterm_interrupts``."""
    if cfg.cluster.kind != "slurm":
        yield
        return
    RunJobs(run_dir).cancel(roles=("rollout", "reward"))
    try:
        yield
    finally:
        RunJobs(run_dir).cancel(roles=("rollout", "reward"))
