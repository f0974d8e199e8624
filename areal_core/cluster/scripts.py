"""Batch scripts: the ``#SBATCH`` lines of a pool's jobs (``cluster:`` and the pool's own), the setup
lines, then the one command the job runs (``exec``: the job's batch process is that command, so a
signal Slurm sends the job reaches it). Nothing secret is written here: a key reaches the job in its
environment (sbatch passes the submitting environment on)."""

from __future__ import annotations

import shlex
import sys

from areal_core.cluster.config import SlurmClusterConfig, SlurmPoolConfig


def python(cluster: SlurmClusterConfig) -> str:
    """The Python the jobs run: ``cluster.python``, else this process's."""
    return cluster.python or sys.executable


def sbatch_options(
    cluster: SlurmClusterConfig, pool: SlurmPoolConfig, *, job_name: str, log: str, array: str | None = None
) -> list[str]:
    """The ``#SBATCH`` options of one pool's job (``array``: e.g. ``0-3``)."""
    opts = [f"--job-name={job_name}", f"--output={log}", "--open-mode=append"]  # a requeued job appends
    optional = {  # (None, 0: the cluster's default)
        "--array": array,
        "--partition": cluster.partition,
        "--account": cluster.account,
        "--time": cluster.time_limit,
        "--nodes": pool.nodes,
        "--ntasks-per-node": pool.tasks_per_node,
        "--cpus-per-task": pool.cpus_per_task,
        "--gpus-per-node": pool.gpus_per_node,
        "--mem": pool.memory,
    }
    opts += [f"{option}={value}" for option, value in optional.items() if value]
    opts.append("--requeue" if cluster.requeue else "--no-requeue")
    return opts + list(cluster.extra_sbatch) + list(pool.extra_sbatch)


def batch_script(options: list[str], setup: list[str], command: str, comment: str = "") -> str:
    """The whole script: ``options`` as ``#SBATCH`` lines, ``setup``, then ``exec command`` (a shell
    line: quote its words with :func:`shlex.join` or :func:`shlex.quote`)."""
    lines = ["#!/bin/bash"]
    if comment:
        lines += [f"# {line}" for line in comment.splitlines()]
    lines += [f"#SBATCH {opt}" for opt in options]
    lines += ["set -eo pipefail", *setup, f"exec {command}", ""]
    return "\n".join(lines)


def quote(words: list[str]) -> str:
    return shlex.join(words)
