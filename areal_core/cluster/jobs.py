"""The Slurm jobs a run submitted, listed in its folder (``RUN/slurm/jobs.json``): what ``areal-flow
runs`` shows, and what stopping the run cancels, by job id. The submitting process and the trainer's
job (on another node, over the shared folder) both add to it; each update holds ``jobs.json.lock``."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from areal_core.cluster import slurm

log = logging.getLogger(__name__)

FOLDER = "slurm"  # under the run folder: job scripts, logs, jobs.json


@dataclass(frozen=True)
class Job:
    job_id: str  # an array job's id stands for all its tasks
    role: str  # trainer, rollout, reward
    log: str  # its log file (an array's: with %a for the task)
    submitted: float  # time.time() at submission


def folder(run_dir: str | Path) -> Path:
    """Where a run's Slurm files go (made if missing)."""
    path = Path(run_dir) / FOLDER
    path.mkdir(parents=True, exist_ok=True)
    return path


class RunJobs:
    """The jobs of the run in ``run_dir``."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / FOLDER / "jobs.json"

    def all(self) -> list[Job]:
        if not self.path.is_file():
            return []
        try:
            return [Job(**j) for j in json.loads(self.path.read_text())]
        except (ValueError, TypeError) as e:
            raise ValueError(f"{self.path}: not a list of Slurm jobs ({e})") from None

    @contextlib.contextmanager
    def _locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(str(self.path) + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def add(self, job_id: str, role: str, log_file: str) -> Job:
        job = Job(job_id, role, log_file, time.time())
        with self._locked():
            listed = [asdict(j) for j in self.all()] + [asdict(job)]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(listed, indent=1) + "\n")
            tmp.replace(self.path)
        return job

    def ids(self, roles: tuple[str, ...] | None = None) -> list[str]:
        return [j.job_id for j in self.all() if roles is None or j.role in roles]

    def cancel(self, roles: tuple[str, ...] | None = None) -> list[str]:
        """Cancel the run's jobs (of ``roles``; None: all) that Slurm still lists; their ids."""
        left = slurm.queued(self.ids(roles))
        if left:
            slurm.cancel(left)
            log.info("cancelled Slurm job(s) %s", " ".join(left))
        return left

    def summary(self) -> str:
        """``trainer 12, rollout 13, reward 14 15``: the job ids by role, in order of submission."""
        by_role: dict[str, list[str]] = {}
        for j in self.all():
            by_role.setdefault(j.role, []).append(j.job_id)
        return ", ".join(f"{role} {' '.join(ids)}" for role, ids in by_role.items())
