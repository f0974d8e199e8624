"""The reward service: grading runs as Dask tasks, submitted without blocking.

A LocalCluster is started by default; ``scheduler_address`` connects to an
existing Dask cluster instead (the same code path: a distributed Client).

A worker that dies (kill -9, OOM) is replaced by its nanny and the scheduler runs
its tasks again elsewhere. A task the scheduler gives up on (``KilledWorker``:
it was running on too many workers that died) is submitted again here, up to
``RESUBMITS`` times; a grader that raises is retried by Dask (``retries``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from areal_core.reward.config import RewardConfig
from areal_core.reward.dispatch import grade, grade_batch
from areal_core.reward.result import RewardResult

log = logging.getLogger(__name__)

RESUBMITS = 3  # per grading task, after KilledWorker


class RewardService:
    def __init__(self, cfg: RewardConfig):
        from distributed import Client, LocalCluster

        self.cfg = cfg
        self._cluster = None
        self.n_resubmitted = 0  # grading tasks submitted again after KilledWorker
        # distributed logs every worker and connection at INFO; keep the console for progress
        logging.getLogger("distributed").setLevel(max(logging.WARNING, logging.getLogger("distributed").level))
        if cfg.scheduler_address:
            self.client = Client(cfg.scheduler_address, timeout="30s")
        else:
            self._cluster = LocalCluster(
                n_workers=cfg.n_workers,
                threads_per_worker=cfg.threads_per_worker,
                processes=True,
                host="127.0.0.1",
                dashboard_address=None,
                worker_dashboard_address=None,
                silence_logs=logging.ERROR,
            )
            self.client = Client(self._cluster)

    @property
    def scheduler_address(self) -> str:
        return self.client.scheduler.address

    def worker_pids(self) -> dict[str, int]:
        """{worker address: process id} of the workers now connected."""
        import os

        return self.client.run(os.getpid)

    def submit(
        self,
        task: str,
        response: str,
        reference: str,
        on_done: Callable[[RewardResult | None, BaseException | None], None],
        tests: list[dict] | None = None,
    ):
        """Submit one grading task; ``on_done(result, error)`` is called from a Dask thread."""
        return self._submit(grade, (task, response, reference, tests), on_done)

    def submit_batch(
        self,
        items: list[tuple[str, str, str, list[dict] | None]],
        on_done: Callable[[list[RewardResult] | None, BaseException | None], None],
    ):
        """Grade ``items`` ``(task, response, reference, tests)`` in ONE Dask task (a group of
        answers: one scheduler round trip instead of one each); ``on_done(results, error)``."""
        return self._submit(grade_batch, (list(items),), on_done)

    def _submit(self, fn, args: tuple, on_done):
        from distributed.scheduler import KilledWorker

        def attempt(k: int):
            fut = self.client.submit(fn, *args, pure=False, retries=2)

            def _done(f):
                try:
                    result = f.result()
                except KilledWorker as e:
                    if k < RESUBMITS:
                        log.warning("grading task lost with its workers (%s); submitting it again", e)
                        self.n_resubmitted += 1
                        attempt(k + 1)
                        return
                    on_done(None, e)
                except BaseException as e:  # delivered to the caller, which decides
                    on_done(None, e)
                else:
                    on_done(result, None)

            fut.add_done_callback(_done)
            return fut

        return attempt(0)

    def grade_many(self, task: str, responses: list[str], references: list[str]) -> list[RewardResult]:
        futs = self.client.map(grade, [task] * len(responses), responses, references, pure=False, retries=2)
        return self.client.gather(futs)

    def close(self) -> None:
        self.client.close()
        if self._cluster is not None:
            self._cluster.close()

    def __enter__(self) -> "RewardService":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
