"""The Slurm commands a run uses, each on job ids: ``sbatch`` (submit), ``scontrol show job``
(state, node, log file), ``scancel`` (cancel, or signal a job's batch process), ``scontrol requeue``.
They read the cluster's ``slurm.conf`` as the command line would (``SLURM_CONF`` in the environment).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

COMMANDS = ("sbatch", "scontrol", "scancel", "squeue")
ENDED = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
        "SPECIAL_EXIT",
    }
)  # the job is no longer running (a requeued one goes back to PENDING)


class SlurmError(RuntimeError):
    """A Slurm command failed; the message names the command and its error."""


class PoolNotReady(RuntimeError):
    """A pool's jobs did not come up in time, or ended before serving; the message names each job's
    id, state, node and log file."""


def log_tail(path: str) -> str:
    """`` (last line: ...)`` of a job's log file, or nothing where it cannot be read."""
    try:
        with open(path, errors="replace") as f:
            f.seek(max(0, os.path.getsize(path) - 4000))
            lines = [line.strip() for line in f.read().splitlines() if line.strip()]
    except OSError:
        return ""
    return f" (last line: {lines[-1]})" if lines else ""


def missing_commands() -> list[str]:
    """The Slurm client commands not on PATH (none: they all are)."""
    return [c for c in COMMANDS if shutil.which(c) is None]


def _run(cmd: list[str], env: Mapping[str, str] | None = None, timeout_s: float = 60.0) -> str:
    if shutil.which(cmd[0]) is None:
        raise SlurmError(f"{cmd[0]}: not found on PATH (is this a Slurm login or compute node?)")
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=dict(env) if env is not None else None, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(cmd[:3])}: no answer from slurmctld within {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        err = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise SlurmError(f"{' '.join(cmd[:3])}: exit {proc.returncode}: {err[-1] if err else '(no output)'}")
    return proc.stdout


def submit(script_path: str, env: Mapping[str, str] | None = None) -> str:
    """Submit the batch script at ``script_path``; its job id. ``env``: the job's environment (sbatch
    passes the submitting environment on: a secret goes there, never in the script or argv)."""
    out = _run(["sbatch", "--parsable", script_path], env=env)
    job_id = out.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch {script_path}: expected a job id, got {out.strip()!r}")
    return job_id


@dataclass(frozen=True)
class JobInfo:
    """One job (or one task of a job array) as ``scontrol show job`` reports it."""

    job_id: str  # "12", or "12_3" for task 3 of array job 12
    state: str  # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...
    reason: str  # why it waits or ended (None: no reason)
    node: str  # the node(s) it runs on ("" while pending)
    log: str  # its StdOut file
    exit_code: str  # "0:0": exit status and signal
    restarts: int  # times it was requeued

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def describe(self) -> str:
        """``job 12_1 RUNNING on n2``, ``job 12_1 PENDING (Resources)``, ``job 12 FAILED (exit 1:0) on n1``."""
        text = f"job {self.job_id} {self.state}"
        if self.state == "PENDING" and self.reason not in ("", "None"):
            text += f" ({self.reason})"
        if self.ended and self.exit_code not in ("", "0:0"):
            text += f" (exit {self.exit_code})"
        if self.node and self.node != "(null)":
            text += f" on {self.node}"
        return text


_FIELD = re.compile(r"(\w+(?:\[\d+\])?)=(\S*)")


def parse_jobs(text: str) -> list[JobInfo]:
    """``scontrol -o show job`` output (one line per job or array task) as :class:`JobInfo`."""
    jobs = []
    for line in text.splitlines():
        fields = dict(_FIELD.findall(line))
        if "JobId" not in fields:
            continue
        job_id = fields["JobId"]
        if fields.get("ArrayTaskId", "N/A") not in ("N/A", "") and "ArrayJobId" in fields:
            job_id = f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}"
        node = fields.get("NodeList", "")
        jobs.append(
            JobInfo(
                job_id=job_id,
                state=fields.get("JobState", "UNKNOWN"),
                reason=fields.get("Reason", ""),
                node="" if node == "(null)" else node,
                log=fields.get("StdOut", ""),
                exit_code=fields.get("ExitCode", ""),
                restarts=int(fields.get("Restarts", "0") or 0),
            )
        )
    return jobs


def jobs(job_id: str) -> list[JobInfo]:
    """The job (every task of an array job); [] once slurmctld no longer knows it."""
    try:
        return parse_jobs(_run(["scontrol", "-o", "show", "job", job_id]))
    except SlurmError as e:
        if "Invalid job id" in str(e):
            return []
        raise


def job(job_id: str) -> JobInfo | None:
    """One job or array task (``12`` or ``12_3``); None once slurmctld no longer knows it."""
    found = [j for j in jobs(job_id) if j.job_id == job_id]
    return found[0] if found else None


def queued(job_ids: Iterable[str]) -> list[str]:
    """Which of ``job_ids`` (array jobs by their id) ``squeue`` still lists, pending or running."""
    ids = sorted(set(job_ids))
    if not ids:
        return []
    out = _run(["squeue", "-h", "-r", "-o", "%i %F"])  # (-j fails whole on one id slurmctld forgot)
    listed = set()
    for line in out.split("\n"):
        parts = line.split()
        if len(parts) == 2:
            listed.update(parts)  # a task's own id ("12_3") and its array job's ("12")
    return [i for i in ids if i in listed]


def cancel(job_ids: Iterable[str]) -> None:
    """``scancel`` these jobs (array jobs whole); one already finished is no error."""
    ids = sorted(set(job_ids))
    if ids:
        _run(["scancel", "--quiet", *ids])


def cancel_and_wait(job_ids: Iterable[str], timeout_s: float = 90.0) -> list[str]:
    """``scancel`` these jobs and wait until ``squeue`` no longer lists them (their processes had
    SIGTERM, then SIGKILL after the cluster's ``KillWait``); the ids still listed at ``timeout_s``."""
    ids = queued(job_ids)
    cancel(ids)
    deadline = time.monotonic() + timeout_s
    while ids and time.monotonic() < deadline:
        time.sleep(0.5)
        ids = queued(ids)
    return ids


def signal(job_id: str, name: str = "INT", batch: bool = True) -> None:
    """Send signal ``name`` to the job's batch process (the command its script ``exec``s), or with
    ``batch=False`` to the tasks of its steps (what ``srun`` started) and not to the batch process."""
    _run(["scancel", "--quiet", *(["--batch"] if batch else []), f"--signal={name}", job_id])


def requeue(job_id: str) -> None:
    """Requeue a running job (``scontrol requeue``): it is stopped and runs again (its ``--requeue``)."""
    _run(["scontrol", "requeue", job_id])


def controller_address(env: Mapping[str, str] | None = None) -> str:
    """The address of the primary slurmctld (``SlurmctldHost`` in ``scontrol show config``)."""
    out = _run(["scontrol", "show", "config"], env=env)
    m = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", out, re.M)
    if m is None:
        raise SlurmError("scontrol show config: no SlurmctldHost[0] line")
    name, address = m.group(1), m.group(2)
    return address or socket.gethostbyname(name)


def environment_for_jobs(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus ``extra``: what sbatch passes to a job (``--export=ALL``),
    without the ``SLURM_*`` variables of a job this process runs in (the new job gets its own;
    ``SLURM_CONF``, which names the cluster, stays)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    return {**env, **(extra or {})}
