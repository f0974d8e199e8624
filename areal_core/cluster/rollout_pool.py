"""The rollout pool as a Slurm job array (a rollout backend: ``rollout/backend.py``'s protocol).

``launch`` writes ``RUN/slurm/rollout.sbatch`` and submits it as an array of ``rollout.n_servers``
tasks; each task runs ``areal-flow rollout-server`` on its node, listening on the node's address
towards the trainer on a free port, and once it serves adds its URL to the run's
``rollout.join_from`` list (``--announce``; it takes it out when it stops). ``launch`` returns once
every task serves, or fails by ``cluster.start_timeout_s`` with one line naming each task's job id,
state, node and log file (at once if a task ends before serving). Leaving it cancels the array.

The pool is elastic: a task Slurm cancels or preempts leaves the pool as a killed server does
(``controller/elastic.py``), and when it is requeued it serves again and announces itself again,
and the run takes it in once it holds the current weights. The run's API key reaches each task in
its environment (sbatch passes the submitting environment on), never in argv or the script.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import time

from areal_core.cluster import slurm
from areal_core.cluster.config import SlurmClusterConfig
from areal_core.cluster.jobs import RunJobs, folder
from areal_core.cluster.scripts import batch_script, python, sbatch_options
from areal_core.cluster.slurm import PoolNotReady, log_tail
from areal_core.rollout.auth import API_KEY_ENV
from areal_core.rollout.backends.embedded.client import EmbeddedClient
from areal_core.rollout.client import check_health_sync
from areal_core.rollout.join_list import announce, read_urls
from areal_core.storage.fsutil import write_text_atomic

log = logging.getLogger(__name__)


def areal_flow_command(cluster: SlurmClusterConfig) -> str:
    """The ``areal-flow`` command beside the jobs' Python (its console script)."""
    return os.path.join(os.path.dirname(python(cluster)), "areal-flow")


class SlurmRolloutBackend:
    name = "slurm"
    restartable = False  # Slurm requeues a task; it then rejoins through the join list
    reads_store_urls = True  # the tasks load the starting version from the checkpoint store (shared)

    def __init__(
        self,
        *,
        n_servers: int,
        cluster: SlurmClusterConfig,
        engine,
        run_dir: str,
        run_name: str,
        api_key: str,
        join_from: str,
        trainer_address: str,
        seed: int,
    ):
        self.n, self.cluster, self.engine, self.seed = n_servers, cluster, engine, seed
        self.run_dir, self.run_name, self.api_key = str(run_dir), run_name, api_key
        self.join_from, self.trainer_address = join_from, trainer_address
        self.jobs = RunJobs(run_dir)
        self.job_id: str | None = None
        self._announced: list[str] = []  # the servers' URLs once they all served

    def script(self, model_path: str, version: int) -> str:
        """The array's batch script; each task's engine settings (its own seed) in a file beside it."""
        from areal_core.rollout.backends.embedded.launcher import server_seed

        where = folder(self.run_dir)
        for k in range(self.n):
            engine = self.engine.model_copy(update={"seed": server_seed(self.seed, k)})
            (where / f"rollout-engine-{k}.json").write_text(engine.model_dump_json())
        engine_file = shlex.quote(str(where / "rollout-engine-")) + '"${SLURM_ARRAY_TASK_ID}.json"'
        words = [
            areal_flow_command(self.cluster),
            "rollout-server",
            "--model-path",
            model_path,
            "--weight-version",
            str(version),
            "--host-towards",
            self.trainer_address,
            "--port",
            "0",
            "--announce",
            self.join_from,
        ]
        command = f'{shlex.join(words)} --engine-config "$(cat {engine_file})"'
        options = sbatch_options(
            self.cluster,
            self.cluster.rollout,
            job_name=f"af-{self.run_name}-rollout",
            log=str(where / "rollout-%A_%a.log"),
            array=f"0-{self.n - 1}",
        )
        comment = f"areal-flow: the rollout servers of the run in {self.run_dir} (one per array task)"
        return batch_script(options, list(self.cluster.setup), command, comment)

    @contextlib.contextmanager
    def launch(self, model_path: str, version: int):
        path = folder(self.run_dir) / "rollout.sbatch"
        write_text_atomic(self.join_from, "")  # a fresh list: the servers of this pool announce there
        path.write_text(self.script(model_path, version))
        self.job_id = slurm.submit(str(path), env=slurm.environment_for_jobs({API_KEY_ENV: self.api_key}))
        self.jobs.add(self.job_id, "rollout", str(folder(self.run_dir) / "rollout-%A_%a.log"))
        log.info("rollout servers: Slurm array job %s (%d tasks)", self.job_id, self.n)
        try:
            yield self.wait_serving(time.monotonic() + self.cluster.start_timeout_s)
        finally:
            self.stop()

    def wait_serving(self, deadline: float) -> list[str]:
        """The URLs of the pool's servers once ``n`` of them serve (``/health``); PoolNotReady if a task
        ends first or ``deadline`` (monotonic) passes."""
        while True:
            serving = [u for u in read_urls(self.join_from) if check_health_sync(u, timeout_s=5.0)]
            if len(serving) >= self.n:
                self._announced = serving
                return serving
            tasks = slurm.jobs(self.job_id)
            ended = [t for t in tasks if t.ended]
            if ended:
                t = ended[0]
                raise PoolNotReady(
                    f"rollout server {t.describe()} ended before serving; its log: {t.log}{log_tail(t.log)}"
                )
            if time.monotonic() > deadline:
                states = "; ".join(f"{t.describe()}, log {t.log}" for t in tasks) or f"job {self.job_id} gone"
                raise PoolNotReady(
                    f"rollout servers: {len(serving)} of {self.n} serving after cluster.start_timeout_s "
                    f"({self.cluster.start_timeout_s:g} s): {states}"
                )
            time.sleep(1.0)

    def stop(self) -> None:
        """Cancel the array and wait until its tasks are gone (each server takes itself out of the join
        list on the SIGTERM; one that could not is taken out here)."""
        if self.job_id is None or not slurm.queued([self.job_id]):
            return
        left = slurm.cancel_and_wait([self.job_id])
        log.info("rollout servers: cancelled Slurm job %s%s", self.job_id, " (still completing)" if left else "")
        if not left:
            announce(self.join_from, self._announced, present=False)

    def restart(self, index: int, model_path: str, version: int) -> None:
        raise RuntimeError(
            f"a rollout server of Slurm job {self.job_id} cannot be restarted from here: Slurm requeues it"
        )

    def client(self, url: str, timeout_s: float = 600.0) -> EmbeddedClient:
        return EmbeddedClient(url, timeout_s, api_key=self.api_key)
